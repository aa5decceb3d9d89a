#include <gtest/gtest.h>

#include <algorithm>

#include "tessel/attention/cp_layout.hpp"
#include "tessel/train/batch_inputs.hpp"

namespace tessel::train {
namespace {

// B rows of T tokens; row r's documents start at doc_starts[r].
data::Batch batch(int64_t T, std::vector<std::vector<int32_t>> doc_starts) {
  data::Batch b;
  b.B = int64_t(doc_starts.size());
  b.T = T;
  b.tokens.assign(size_t(b.B * T), 1);
  b.targets.assign(size_t(b.B * T), 2);
  b.loss_mask.assign(size_t(b.B * T), 1.0f);
  for (int64_t r = 0; r < b.B; ++r)
    for (int32_t t = 0; t < T; ++t) b.positions.push_back(t);
  b.doc_starts = std::move(doc_starts);
  return b;
}

data::Batch two_rows() {
  return batch(6, {{0, 2, 5}, {0}});
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

// Every rank owns `per_rank` chunks and every chunk has exactly one owner.
void expect_partition(const attention::CpLayout& l, int P, int64_t per_rank) {
  ASSERT_EQ(l.ranks(), P);
  std::vector<int> owners(size_t(l.num_chunks()), 0);
  for (const auto& ids : l.owned) {
    EXPECT_EQ(int64_t(ids.size()), per_rank);
    for (int64_t c : ids) ++owners[size_t(c)];
  }
  EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int n) { return n == 1; }));
}

// The layout every cp rank computes for itself: each kind partitions the chunks; under a causal
// mask of 8 equal chunks (8 rows, 8-column tiles) chunk c holds c + 1 tiles per head, so the
// balanced layout reaches max/mean = 1 exactly, and contiguous (ranks 0..3 and 4..7:
// 10 and 26 tiles) 26 / 18.
TEST(MicroBatchLayout, EachKindPartitionsAndBalancedEvensTheWork) {
  model::GptConfig model;
  model.heads = 2;
  ParallelConfig p;
  p.cp_chunks = 4;
  const data::Batch causal = batch(64, {{0}});
  const BatchInputs in(causal, AttentionMaskKind::causal);
  double imbalance[3];
  int i = 0;
  for (CpLayoutKind kind :
       {CpLayoutKind::zigzag, CpLayoutKind::contiguous, CpLayoutKind::balanced}) {
    p.cp_layout = kind;
    const attention::CpLayout l = micro_batch_layout(in.inputs(), 2, p, model);
    expect_partition(l, 2, kind == CpLayoutKind::zigzag ? 2 : 4);
    const std::vector<int64_t> work = attention::chunk_work(
        attention::TiledMask(attention::ColumnMask::causal_only(1, 64, 64), l.chunk), l.chunk, 2, 2,
        l.chunk);
    imbalance[i++] = attention::imbalance(l, work);
  }
  EXPECT_DOUBLE_EQ(imbalance[0], 1.0);  // zigzag pairs chunk r with 2P - 1 - r
  EXPECT_DOUBLE_EQ(imbalance[1], 26.0 / 18.0);
  EXPECT_DOUBLE_EQ(imbalance[2], 1.0);

  // Documents: balanced never does worse than contiguous on the micro-batch's own mask.
  const data::Batch docs = batch(64, {{0, 5, 30, 33, 60}});
  const BatchInputs doc_in(docs, AttentionMaskKind::causal_document);
  p.cp_layout = CpLayoutKind::contiguous;
  const attention::CpLayout contiguous = micro_batch_layout(doc_in.inputs(), 2, p, model);
  p.cp_layout = CpLayoutKind::balanced;
  const attention::CpLayout balanced = micro_batch_layout(doc_in.inputs(), 2, p, model);
  expect_partition(balanced, 2, 4);
  const std::vector<int64_t> work =
      attention::chunk_work(attention::TiledMask(*doc_in.inputs().mask, 8), 8, 2, 2, 8);
  EXPECT_LE(attention::imbalance(balanced, work), attention::imbalance(contiguous, work));
  EXPECT_LT(attention::imbalance(balanced, work), 1.05);
}

}  // namespace
}  // namespace tessel::train
