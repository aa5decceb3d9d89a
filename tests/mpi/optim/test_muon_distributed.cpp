// Distributed Muon / Dion2 / Dion3 (ZeRO-1 megabatch, replicated, all-gather baseline) on 2
// and 4 ranks against the same optimizer on one process: bitwise equal parameters and state
// (each rank's row shards are rows of the one-process state), collectives per step, a state
// listing without communication, bitwise resume; local-scope selection against its
// emulation on one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "support/expect_input_error.hpp"
#include "support/optimizer_state.hpp"
#include "support/param_fixture.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/optim/muon.hpp"
#include "tessel/optim/newton_schulz.hpp"
#include "tessel/optim/row_selection.hpp"

using namespace tessel;
using namespace tessel::optim;
using tessel::fixture::ParamSet;
using tessel::fixture::state_bytes;

namespace {

const std::vector<ParamTag> kDecay = {ParamTag::hidden_matrix, ParamTag::embedding, ParamTag::head};
AdamWHyper adam() {
  return {1e-2, 0.9, 0.95, 1e-8, 0.1};
}

MuonHyper hyper(MuonVariant v, MuonMode mode, bool local) {
  MuonHyper h;
  h.variant = v;
  h.mode = mode;
  h.local_scope = local;
  h.lr = 0.05;
  h.weight_decay = 0.1;
  h.nesterov = v == MuonVariant::muon;
  h.ns.gram_min = 8;  // the Gram path on the wide test matrices too
  return h;
}

// Steps with gradients seeded from `seed` (the same on every rank, as after the dp
// all-reduce).
void run(Muon& opt, ParamSet& ps, uint64_t seed, int steps) {
  for (int s = 0; s < steps; ++s) {
    ps.random_grads(seed + uint64_t(s));
    opt.step(0.5 + 0.2 * s);
  }
}

struct Case {
  MuonVariant variant;
  MuonMode mode;
  bool local;
};

// Every tensor of `mine` (whole, or a row shard) equals its rows of the same-named tensor of
// `whole` (one process's state) bitwise.
void expect_rows_of(const std::vector<StateTensor>& mine, const std::vector<StateTensor>& whole) {
  for (const StateTensor& s : mine) {
    auto w = std::find_if(whole.begin(), whole.end(),
                          [&](const StateTensor& t) { return t.name == s.name; });
    ASSERT_NE(w, whole.end()) << s.name;
    ASSERT_EQ(w->tensor.shape()[0], s.is_shard() ? s.rows : s.tensor.shape()[0]) << s.name;
    const size_t row = w->tensor.bytes() / size_t(w->tensor.shape()[0]);
    ASSERT_LE(size_t(s.row0) * row + s.tensor.bytes(), w->tensor.bytes()) << s.name;
    EXPECT_EQ(std::memcmp(static_cast<const char*>(w->tensor.raw()) + size_t(s.row0) * row,
                          s.tensor.raw(), s.tensor.bytes()),
              0)
        << s.name << " from row " << s.row0;
  }
}

// Global-scope selection and plain Muon give, on P ranks, bitwise what one process gives.
TEST(MuonDistributed, BitwiseEqualToOneProcess) {
  comm::Communicator& world = comm::world();
  for (MuonVariant v : {MuonVariant::muon, MuonVariant::dion2, MuonVariant::dion3})
    for (MuonMode mode : {MuonMode::sharded, MuonMode::replicated, MuonMode::allgather}) {
      SCOPED_TRACE(testing::Message() << "variant " << int(v) << " mode " << int(mode));
      const MuonHyper h = hyper(v, mode, false);
      ParamSet dist(fixture::muon_test_specs(), 1), one(fixture::muon_test_specs(), 1);
      Muon a(dist.params, h, adam(), kDecay, &world);
      Muon b(one.params, h, adam(), kDecay, nullptr);
      run(a, dist, 100, 3);
      run(b, one, 100, 3);
      EXPECT_EQ(dist.snapshot(), one.snapshot());
      // The checkpoint state is layout-independent: each rank's rows are the one process's.
      expect_rows_of(a.state(), b.state());
    }
}

// Local scope selects per shard, so it differs from one process, but every rank ends with
// the same parameters and state (the parameters stay replicated).
TEST(MuonDistributed, LocalScopeKeepsRanksInAgreement) {
  comm::Communicator& world = comm::world();
  for (MuonVariant v : {MuonVariant::dion2, MuonVariant::dion3}) {
    ParamSet ps(fixture::muon_test_specs(), 2);
    Muon opt(ps.params, hyper(v, MuonMode::sharded, true), adam(), kDecay, &world);
    run(opt, ps, 200, 3);
    std::vector<float> mine = ps.snapshot(), root = mine;
    world.broadcast(root, 0);
    EXPECT_EQ(mine, root);
  }
}

// Local scope written out on one process: per matrix (row block), rank q's shard is rows
// [q b, (q + 1) b) with b = ceil(rows / P); each shard selects its own top k = max(1, ceil(f n))
// of its n rows by l1 norm of the accumulated momentum (ties to the lower row); the union, in
// row order, is orthogonalized as one submatrix (Dion3: NorMuon on it), stepped with the
// submatrix shape's lr_adjust, and its momentum rows decay by ef_decay. The emulation calls
// the same orthogonalize, normuon_normalize and lr_adjust in the same f32 order as Muon, so the
// distributed parameters and each rank's state rows equal it bitwise.
TEST(MuonDistributed, LocalScopeEqualsPerShardSelectionOnOneProcess) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const std::map<std::string, std::vector<int64_t>> blocks = {{"b1.qkv", {8, 8, 8}}};
  for (MuonVariant v : {MuonVariant::dion2, MuonVariant::dion3}) {
    SCOPED_TRACE(v == MuonVariant::dion2 ? "dion2" : "dion3");
    const MuonHyper h = hyper(v, MuonMode::sharded, true);
    ParamSet dist(fixture::muon_test_specs(), 6), emu(fixture::muon_test_specs(), 6);
    Muon opt(dist.params, h, adam(), kDecay, &world, blocks);
    run(opt, dist, 600, 3);

    std::map<std::string, std::vector<float>> M, V;  // whole momentum and second moments
    for (int s = 0; s < 3; ++s) {
      emu.random_grads(600 + uint64_t(s));
      const double lr = h.lr * (0.5 + 0.2 * s);
      const float decay = float(1.0 - lr * h.weight_decay);
      for (Parameter& p : emu.params) {
        if (p.tag != ParamTag::hidden_matrix) continue;
        const int64_t rows = p.value.shape()[0], cols = p.value.shape()[1];
        M[p.name].resize(size_t(rows * cols), 0.0f);
        V[p.name].resize(size_t(rows), 0.0f);
        const auto it = blocks.find(p.name);
        int64_t row0 = 0;
        for (int64_t b : it == blocks.end() ? std::vector<int64_t>{rows} : it->second) {
          float* W = p.value.f32() + row0 * cols;
          const float* G = p.grad.f32() + row0 * cols;
          float* B = M[p.name].data() + row0 * cols;
          for (int64_t i = 0; i < b * cols; ++i) B[i] = B[i] + G[i];
          std::vector<int64_t> S;  // selected rows of the block, shard by shard
          const int64_t per = (b + P - 1) / P;
          for (int q = 0; q < P; ++q) {
            const int64_t lo = std::min(b, q * per), hi = std::min(b, (q + 1) * per);
            if (hi == lo) continue;
            std::vector<double> score;
            std::vector<int64_t> order;
            for (int64_t r = lo; r < hi; ++r) {
              double l1 = 0;
              for (int64_t j = 0; j < cols; ++j) l1 += std::abs(double(B[r * cols + j]));
              score.push_back(l1);
              order.push_back(r);
            }
            std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
              return score[size_t(x - lo)] > score[size_t(y - lo)];
            });
            const auto k = std::max<int64_t>(1, int64_t(std::ceil(h.fraction * double(hi - lo))));
            order.resize(size_t(k));
            std::sort(order.begin(), order.end());
            S.insert(S.end(), order.begin(), order.end());
          }
          const int64_t k = int64_t(S.size());
          std::vector<float> A(size_t(k * cols)), O(A.size()), step(A.size());
          for (int64_t i = 0; i < k; ++i)
            std::copy_n(B + S[size_t(i)] * cols, cols, A.data() + i * cols);
          orthogonalize(A.data(), k, cols, h.ns, O.data());
          if (v == MuonVariant::dion3)
            normuon_normalize(O.data(), k, cols, S.data(), V[p.name].data() + row0, h.normuon_beta2,
                              h.normuon_eps);
          const float scale = float(lr * lr_adjust(h.lr_rule, k, cols));
          for (size_t i = 0; i < O.size(); ++i) step[i] = scale * O[i];
          for (int64_t i = 0; i < b * cols; ++i) W[i] *= decay;
          for (int64_t i = 0; i < k; ++i)
            for (int64_t j = 0; j < cols; ++j) {
              W[S[size_t(i)] * cols + j] -= step[size_t(i * cols + j)];
              B[S[size_t(i)] * cols + j] *= float(h.ef_decay);
            }
          row0 += b;
        }
      }
    }
    // The hidden matrices; the other parameters are AdamW's (BitwiseEqualToOneProcess).
    for (size_t i = 0; i < dist.params.size(); ++i) {
      const Parameter &d = dist.params[i], &e = emu.params[i];
      if (d.tag != ParamTag::hidden_matrix) continue;
      EXPECT_EQ(std::memcmp(d.value.raw(), e.value.raw(), d.value.bytes()), 0) << d.name;
    }
    // Each rank's momentum and second-moment rows are the emulation's.
    std::vector<StateTensor> mine, whole;
    for (const StateTensor& st : opt.state())
      if (st.name.rfind(opt.name() + ".m/", 0) == 0 || st.name.rfind(opt.name() + ".v/", 0) == 0)
        mine.push_back(st);
    for (const Parameter& p : emu.params) {
      if (p.tag != ParamTag::hidden_matrix) continue;
      Tensor m(p.value.shape()), vt(Shape{p.value.shape()[0]});
      std::copy(M[p.name].begin(), M[p.name].end(), m.f32());
      std::copy(V[p.name].begin(), V[p.name].end(), vt.f32());
      whole.push_back({opt.name() + ".m/" + p.name, m});
      whole.push_back({opt.name() + ".v/" + p.name, vt});
    }
    ASSERT_FALSE(mine.empty());
    expect_rows_of(mine, whole);
  }
}

// Sharded: one all_to_allv and one all_gatherv per shape group and step, nothing else;
// replicated: one all_gatherv per group; allgather baseline: one per matrix.
TEST(MuonDistributed, CollectivesPerStep) {
  comm::Communicator& world = comm::world();
  for (Case c : {Case{MuonVariant::muon, MuonMode::sharded, false},
                 Case{MuonVariant::dion3, MuonMode::sharded, true},
                 Case{MuonVariant::muon, MuonMode::replicated, false},
                 Case{MuonVariant::muon, MuonMode::allgather, false}}) {
    ParamSet ps(fixture::muon_test_specs(), 3);
    Muon opt(ps.params, hyper(c.variant, c.mode, c.local), adam(), kDecay, &world);
    EXPECT_EQ(opt.shape_groups(), 4);
    ps.random_grads(1);
    world.reset_traffic();
    opt.step(1.0);
    opt.step(1.0);
    const comm::TrafficCounts calls = world.traffic().calls;
    const uint64_t groups = uint64_t(opt.shape_groups()), mats = uint64_t(opt.matrices());
    if (c.mode == MuonMode::sharded) {
      EXPECT_EQ(calls.all_to_all, 2 * groups);
      EXPECT_EQ(calls.all_gather, 2 * groups);
      EXPECT_EQ(calls.total(), 2 * 2 * groups);  // 2 steps
    } else if (c.mode == MuonMode::replicated) {
      EXPECT_EQ(calls.total(), 2 * groups);
      EXPECT_EQ(calls.all_gather, 2 * groups);
    } else {
      EXPECT_EQ(calls.total(), 2 * mats);
      EXPECT_EQ(calls.all_gather, 2 * mats);
    }
  }
}

// ZeRO-1 state is listed as views of each rank's own rows, without communication: the
// momentum of a sharded (or allgather) matrix as ceil(rows / P)-row shards of each row block,
// dion3's second moments by each matrix's owner (every rank in the allgather mode). Over the
// ranks the shards of a tensor add up to the whole (each rank's rows are checked against the
// one-process state in BitwiseEqualToOneProcess). Replicated momentum is whole on every rank.
TEST(MuonDistributed, StateListsOnlyThisRanksShardsWithoutCommunication) {
  comm::Communicator& world = comm::world();
  const int P = world.size(), me = world.rank();
  const std::map<std::string, std::vector<int64_t>> blocks = {{"b1.qkv", {8, 8, 8}}};
  for (MuonMode mode : {MuonMode::sharded, MuonMode::allgather, MuonMode::replicated}) {
    SCOPED_TRACE(testing::Message() << "mode " << int(mode));
    ParamSet ps(fixture::muon_test_specs(), 5);
    Muon opt(ps.params, hyper(MuonVariant::dion3, mode, false), adam(), kDecay, &world, blocks);
    run(opt, ps, 500, 2);
    world.reset_traffic();
    const std::vector<StateTensor> st = opt.state();
    EXPECT_EQ(world.traffic().calls.total(), 0u);
    // Expected elements per state kind: this rank's momentum rows, and over all ranks.
    int64_t m_mine = 0, m_all = 0, v_all = 0;
    for (const Parameter& p : ps.params) {
      if (p.tag != ParamTag::hidden_matrix) continue;
      const int64_t rows = p.value.shape()[0], cols = p.value.shape()[1];
      auto it = blocks.find(p.name);
      for (int64_t b : it == blocks.end() ? std::vector<int64_t>{rows} : it->second) {
        const int64_t per = (b + P - 1) / P;
        m_mine +=
            (mode == MuonMode::replicated ? b
                                          : std::min(b, (me + 1) * per) - std::min(b, me * per)) *
            cols;
      }
      m_all += rows * cols;
      v_all += rows;
    }
    int64_t counts[3] = {0, 0, 0};  // momentum here, momentum and second moments over ranks
    for (const StateTensor& s : st) {
      const bool m = s.name.rfind("dion3.m/", 0) == 0, v = s.name.rfind("dion3.v/", 0) == 0;
      EXPECT_EQ(s.is_shard(),
                (m && mode != MuonMode::replicated) || (v && mode != MuonMode::allgather))
          << s.name;
      if (m) counts[0] += s.tensor.numel(), counts[1] += s.tensor.numel();
      if (v) counts[2] += s.tensor.numel();
    }
    EXPECT_EQ(counts[0], m_mine);
    world.all_reduce(std::span<int64_t>(counts + 1, 2));
    EXPECT_EQ(counts[1], mode == MuonMode::replicated ? P * m_all : m_all);
    EXPECT_EQ(counts[2], mode == MuonMode::allgather ? P * v_all : v_all);
  }
}

// A collective beyond MPI's int count (2^31 - 1 elements) is refused when Muon is built,
// naming the shape and the limit, not at the first step: 2047 matrices [1024, 1024] move
// 2047 x 1024 x 1025 = 2148531200 floats per shape group (2046 would fit). The matrices are
// views of one 4 MB buffer; the check comes before the momentum is allocated.
TEST(MuonDistributed, AShapeGroupBeyondMpisIntCountIsRefusedAtConstruction) {
  comm::Communicator& world = comm::world();
  const int64_t n = 2047, rows = 1024, cols = 1024;
  Tensor value(Shape{rows, cols}), grad(Shape{rows, cols});
  ParameterList params;
  for (int64_t i = 0; i < n; ++i)
    params.push_back({std::string("w").append(std::to_string(i)), ParamTag::hidden_matrix,
                      value.view(0, {rows, cols}), grad.view(0, {rows, cols})});
  for (MuonMode mode : {MuonMode::sharded, MuonMode::replicated})
    fixture::expect_input_error(
        [&] { Muon opt(params, hyper(MuonVariant::dion3, mode, true), adam(), kDecay, &world); },
        {mode == MuonMode::sharded ? "optim.muon_mode = sharded" : "optim.muon_mode = replicated",
         "2047 hidden matrices of shape [1024, 1024] (w0, ...)", "2147483647", "allgather"});
}

// Save (this rank's state()), run on, restore into a fresh distributed optimizer of the same
// layout: the continuation repeats bitwise.
TEST(MuonDistributed, ResumeIsBitwise) {
  comm::Communicator& world = comm::world();
  for (MuonVariant v : {MuonVariant::muon, MuonVariant::dion3}) {
    const MuonHyper h = hyper(v, MuonMode::sharded, true);
    ParamSet ps(fixture::muon_test_specs(), 4);
    Muon opt(ps.params, h, adam(), kDecay, &world);
    run(opt, ps, 300, 2);
    const auto saved = state_bytes(opt);
    const auto params = ps.snapshot();
    run(opt, ps, 400, 2);
    const auto expected = ps.snapshot();
    std::memcpy(ps.values.f32(), params.data(), params.size() * sizeof(float));
    Muon fresh(ps.params, h, adam(), kDecay, &world);
    fixture::load_state_bytes(fresh, saved);
    run(fresh, ps, 400, 2);
    EXPECT_EQ(ps.snapshot(), expected);
  }
}

}  // namespace
