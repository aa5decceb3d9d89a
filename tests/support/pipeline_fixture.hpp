#pragma once
// Helpers for the trainer tests that compare runs (the pipeline's above all): a run's final
// weights (its last checkpoint) and the bitwise comparisons of two runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "tessel/train/checkpoint.hpp"
#include "tessel/train/trainer.hpp"

namespace tessel::fixture {

// The model tensors of the newest checkpoint under `run_dir`, by name.
inline std::map<std::string, std::vector<float>> final_weights(const std::string& run_dir) {
  train::CheckpointStore store(run_dir + "/checkpoints", 2);
  auto latest = store.latest();
  EXPECT_TRUE(latest.has_value()) << run_dir << " holds no checkpoint";
  std::map<std::string, std::vector<float>> out;
  if (!latest) return out;
  for (const auto& t : train::CheckpointStore::load(*latest).model)
    out[t.name] = std::vector<float>(t.tensor.f32(), t.tensor.f32() + t.tensor.numel());
  return out;
}

// Losses, and unless `norms_too` is false the gradient norms, of every step bitwise equal.
inline void expect_same_steps(const train::TrainResult& a, const train::TrainResult& b,
                              bool norms_too = true) {
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    if (norms_too) {
      EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << i + 1;
    }
  }
  EXPECT_EQ(a.validation, b.validation);
  EXPECT_EQ(a.data_set_validation, b.data_set_validation);
}

// `r` after step `from`: what a run resumed from step `from`'s checkpoint repeats (its steps
// and validations after `from`).
inline train::TrainResult after_step(train::TrainResult r, int64_t from) {
  r.steps.erase(r.steps.begin(), r.steps.begin() + std::min<int64_t>(from, r.steps.size()));
  size_t done = 0;
  while (done < r.validation.size() && r.validation[done].first <= from) ++done;
  r.validation.erase(r.validation.begin(), r.validation.begin() + done);
  r.data_set_validation.erase(r.data_set_validation.begin(), r.data_set_validation.begin() + done);
  return r;
}

inline void expect_same_weights(const std::map<std::string, std::vector<float>>& a,
                                const std::map<std::string, std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (const auto& [name, values] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    ASSERT_EQ(values.size(), it->second.size()) << name;
    EXPECT_EQ(0, std::memcmp(values.data(), it->second.data(), values.size() * sizeof(float)))
        << name << " differs";
  }
}

}  // namespace tessel::fixture
