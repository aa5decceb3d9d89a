#include <gtest/gtest.h>

#include "tessel/train/batch_inputs.hpp"

namespace tessel::train {
namespace {

data::Batch two_rows() {
  data::Batch b;
  b.B = 2;
  b.T = 6;
  b.tokens.assign(12, 1);
  b.targets.assign(12, 2);
  b.loss_mask.assign(12, 1.0f);
  for (int r = 0; r < 2; ++r)
    for (int t = 0; t < 6; ++t) b.positions.push_back(t);
  b.doc_starts = {{0, 2, 5}, {0}};
  return b;
}

TEST(BatchInputs, CausalDocumentRestartsPositionsAndMasksAcrossDocuments) {
  const data::Batch b = two_rows();
  const BatchInputs in(b, AttentionMaskKind::causal_document);
  const model::ModelInputs& m = in.inputs();
  EXPECT_EQ(std::vector<int32_t>(m.positions, m.positions + 12),
            (std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5}));
  ASSERT_NE(m.mask, nullptr);
  // Row 0: documents [0, 2), [2, 5), [5, 6); row 1 is one document (plain causal).
  const auto doc = [](int64_t r, int64_t t) { return r == 1 ? 0 : (t < 2 ? 0 : t < 5 ? 1 : 2); };
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = 0; j < 6; ++j)
        EXPECT_EQ(m.mask->visible(r, 0, i, j), j <= i && doc(r, i) == doc(r, j))
            << "row " << r << " i " << i << " j " << j;
  EXPECT_EQ(m.tokens, b.tokens.data());
  EXPECT_EQ(m.loss_weight, b.loss_mask.data());
}

TEST(BatchInputs, CausalKeepsRowPositionsAndNoMask) {
  const data::Batch b = two_rows();
  const BatchInputs in(b, AttentionMaskKind::causal);
  EXPECT_EQ(in.inputs().mask, nullptr);
  EXPECT_EQ(in.inputs().positions, b.positions.data());
}

}  // namespace
}  // namespace tessel::train
