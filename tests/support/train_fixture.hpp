#pragma once
// Helpers for trainer tests: a small synthetic dataset and tiny configs.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/prepare.hpp"
#include "tessel/train/config.hpp"
#include "tessel/train/trainer.hpp"

namespace tessel::fixture {

// Sentences drawn from a small vocabulary: enough structure for the loss to fall.
inline std::vector<std::string> synthetic_documents(int count, uint64_t seed) {
  const char* words[] = {"the",   "light", "was",   "good", "and", "god",   "said", "let",
                         "there", "be",    "water", "land", "day", "night", "made", "saw"};
  Rng rng(seed);
  std::vector<std::string> docs;
  for (int d = 0; d < count; ++d) {
    std::string doc;
    int sentences = 2 + int(rng.below(4));
    for (int s = 0; s < sentences; ++s) {
      int n = 3 + int(rng.below(6));
      for (int w = 0; w < n; ++w) doc += std::string(words[rng.below(16)]) + (w + 1 < n ? " " : "");
      doc += ".\n";
    }
    docs.push_back(doc);
  }
  return docs;
}

// How the test data sets are prepared: a tenth held out for validation.
inline data::PrepareOptions test_prepare_options(const std::string& dir,
                                                 const std::string& corpus) {
  data::PrepareOptions options;
  options.corpus = corpus;
  options.output_dir = dir;
  options.val_fraction = 0.1;
  options.seed = 0;
  return options;
}

// Writes train.tok / val.tok under `dir` (created) and returns `dir`.
inline std::string make_dataset(const std::string& dir) {
  data::prepare_documents(synthetic_documents(400, 11), test_prepare_options(dir, "synthetic"));
  return dir;
}

// A second, smaller data set of other documents (mixtures): train.tok / val.tok under `dir`.
inline std::string make_other_dataset(const std::string& dir) {
  data::prepare_documents(synthetic_documents(150, 21), test_prepare_options(dir, "synthetic"));
  return dir;
}

// Questions of 2..9 of the same words, each answered by its words in reverse order: enough
// structure for fine-tuning to learn.
inline std::vector<data::SftSample> synthetic_conversations(int count, uint64_t seed) {
  const auto questions = synthetic_documents(count, seed);
  std::vector<data::SftSample> samples;
  for (const std::string& doc : questions) {
    const std::string question = doc.substr(0, doc.find('.'));
    std::vector<std::string> words;
    for (size_t b = 0, e; b < question.size(); b = e + 1) {
      e = std::min(question.find(' ', b), question.size());
      words.push_back(question.substr(b, e - b));
    }
    std::string reply;
    for (auto w = words.rbegin(); w != words.rend(); ++w)
      reply += *w + (w + 1 != words.rend() ? " " : ".");
    const data::ChatMessage conversation[2] = {{"user", "Reverse: " + question + "."},
                                               {"assistant", reply}};
    samples.push_back(data::render_conversation(conversation, "synthetic"));
  }
  return samples;
}

// Writes the SFT data set of 400 synthetic conversations under `dir` and returns `dir`.
inline std::string make_sft_dataset(const std::string& dir) {
  data::prepare_samples(synthetic_conversations(400, 12),
                        test_prepare_options(dir, "chat:synthetic"));
  return dir;
}

// A tiny GPT (GQA, rotary, swiglu, rmsnorm) with quiet logging and no sample.
inline train::Config tiny_config(const std::string& data_dir, const std::string& run_dir) {
  return train::load_config(
      "", {"data.path=" + data_dir,  "run.dir=" + run_dir,     "run.quiet=true",
           "run.threads=1",          "model.layers=2",         "model.width=32",
           "model.heads=4",          "model.kv_heads=2",       "model.mlp=swiglu",
           "model.norm=rmsnorm",     "model.positions=rotary", "model.tied_head=false",
           "model.bias=false",       "model.max_seq=16",       "train.seq_len=16",
           "train.micro_batch=2",    "train.steps=50",         "train.eval_every=0",
           "train.eval_sequences=8", "train.sample_tokens=0",  "optim.lr=3e-3",
           "optim.min_lr=3e-4",      "optim.warmup_steps=5",   "mfu.peak_gflops=1"});
}

// Trains `c` to its end over `comm`.
inline train::TrainResult run_on(comm::Communicator& comm, train::Config c) {
  train::Trainer trainer(std::move(c), comm);
  return trainer.run();
}

// Trains `c` to its end on this process alone.
inline train::TrainResult train_run(const train::Config& c) {
  comm::SingleCommunicator self;
  return run_on(self, c);
}

// A fresh directory under the system temp dir, removed when the test binary exits.
inline std::string temp_dir(const std::string& stem) {
  static std::vector<std::string> made;  // constructed before `cleanup`, so destroyed after it
  struct RemoveAtExit {
    ~RemoveAtExit() {
      std::error_code ignored;
      for (const auto& d : made) std::filesystem::remove_all(d, ignored);
    }
  };
  static RemoveAtExit cleanup;
  std::string tmpl = (std::filesystem::temp_directory_path() / (stem + "-XXXXXX")).string();
  char* dir = mkdtemp(tmpl.data());
  if (!dir) return std::string();
  made.emplace_back(dir);
  return made.back();
}

}  // namespace tessel::fixture
