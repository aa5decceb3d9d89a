#include <gtest/gtest.h>

#include "tessel/attention/mask_builders.hpp"
#include "tessel/core/error.hpp"
#include "tessel/model/gpt.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;

namespace {

struct LossAndGrads {
  double loss;
  std::vector<double> grads;
};

LossAndGrads run(Gpt& gpt, const ModelInputs& in) {
  auto acts = gpt.make_activations(in.B, in.T);
  gpt.zero_grads();
  const double loss = gpt.forward(*acts, in);
  gpt.backward(*acts, 1.0f);
  const Tensor g = gpt.flat_grads();
  return {loss, std::vector<double>(g.f32(), g.f32() + g.numel())};
}

// A packed batch (two rows of several documents, causal-document mask, positions restarting
// at every document) gives the loss and gradients of its documents run one by one: nothing
// attends across a document boundary. Tolerance 1e-5 relative to the largest gradient.
void expect_packing_exact(GptConfig config) {
  config.max_seq = 16;
  Gpt gpt(config, 3);
  randomize_parameters(gpt, 4, 0.3f);
  const int64_t T = 16;
  const std::vector<std::vector<int32_t>> starts = {{0, 5, 8}, {0, 11}};
  const Batch packed_data = random_batch(config, 2, T, 9, false);
  std::vector<int32_t> positions(size_t(2 * T));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0, d = 0; t < T; ++t) {
      if (d + 1 < int64_t(starts[b].size()) && t == starts[b][size_t(d + 1)]) ++d;
      positions[size_t(b * T + t)] = int32_t(t - starts[b][size_t(d)]);
    }
  const attention::ColumnMask mask = attention::causal_document_batch_mask(starts, T);
  ModelInputs packed = packed_data.inputs();
  packed.positions = positions.data();
  packed.mask = &mask;
  const LossAndGrads whole = run(gpt, packed);

  double loss = 0;
  std::vector<double> grads(whole.grads.size(), 0.0);
  for (int64_t b = 0; b < 2; ++b)
    for (size_t d = 0; d < starts[b].size(); ++d) {
      const int64_t s = starts[b][d];
      const int64_t e = d + 1 < starts[b].size() ? starts[b][d + 1] : T;
      const size_t o = size_t(b * T + s);
      const ModelInputs doc{1,
                            e - s,
                            packed_data.tokens.data() + o,
                            nullptr,
                            packed_data.targets.data() + o,
                            packed_data.weight.data() + o};
      const LossAndGrads part = run(gpt, doc);
      loss += part.loss;
      for (size_t i = 0; i < grads.size(); ++i) grads[i] += part.grads[i];
    }
  EXPECT_NEAR(whole.loss, loss, 1e-5 * std::abs(loss));
  EXPECT_LT(kernels::test::rel_error(whole.grads, grads), 1e-5);
}

TEST(DocumentPacking, PackedEqualsOneByOneLearnedPositions) {
  expect_packing_exact(gelu_config());
}
TEST(DocumentPacking, PackedEqualsOneByOneRotary) {
  expect_packing_exact(swiglu_config());
}

// Without the mask, packed rows attend across documents: the losses differ (the test above
// can fail).
TEST(DocumentPacking, CausalMaskLeaksAcrossDocuments) {
  GptConfig config = gelu_config();
  config.max_seq = 16;
  Gpt gpt(config, 3);
  randomize_parameters(gpt, 4, 0.3f);
  const Batch data = random_batch(config, 1, 16, 9, false);
  const attention::ColumnMask mask = attention::causal_document_batch_mask({{0, 8}}, 16);
  ModelInputs with_mask = data.inputs();
  with_mask.mask = &mask;
  EXPECT_GT(std::abs(run(gpt, data.inputs()).loss - run(gpt, with_mask).loss), 1e-3);
}

TEST(DocumentPacking, RejectsAMaskOfTheWrongShape) {
  GptConfig config = gelu_config();
  Gpt gpt(config, 3);
  const Batch data = random_batch(config, 1, 6, 9, false);
  const attention::ColumnMask mask = attention::ColumnMask::causal_only(1, 5, 5);
  ModelInputs in = data.inputs();
  in.mask = &mask;
  auto acts = gpt.make_activations(1, 6);
  EXPECT_THROW(gpt.forward(*acts, in), InputError);
}

}  // namespace
