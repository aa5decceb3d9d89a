#pragma once
// Which data set each global sequence comes from when a run blends several (data.path lists
// them, data.weights gives their shares; docs/training.md, "Data mixtures").
//
// Sequence g goes to the data set d with the largest deficit w_d * (g + 1) - c_d(g), where
// c_d(g) counts the sequences before g that went to d, ties to the lowest d (the greedy
// interleaving Megatron-LM's blended data sets use). It is deterministic and depends on the
// weights alone. No data set is ever a whole sequence ahead of its share: c_d(n) < w_d * n + 1
// for every prefix n (the data set picked had a positive deficit). With two data sets each
// stays within half a sequence of its share; with more, one may fall a little further behind
// (at most 1.22 sequences in a search over random weights for up to 8 data sets). Within
// data set d the c_d(g)-th sequence is taken, so each data set is read in its own order,
// repeating it (epochs) as often as its share asks.
#include <cstdint>
#include <vector>

namespace tessel::data {

class MixtureOrder {
 public:
  // `weights`: one positive, finite share per data set, normalized here; InputError otherwise.
  explicit MixtureOrder(std::vector<double> weights);

  struct Slot {
    int64_t source = 0;  // the data set
    int64_t index = 0;   // its sequence number within that data set
    bool operator==(const Slot&) const = default;
  };
  // Global sequence g >= 0. Amortized O(data sets) for increasing g; a jump back costs at most
  // kBlock steps from the nearest remembered block start.
  Slot locate(int64_t g);

  const std::vector<double>& weights() const { return weights_; }  // normalized, sum 1
  int64_t sources() const { return int64_t(weights_.size()); }

 private:
  static constexpr int64_t kBlock = 1024;
  int64_t pick(int64_t g) const;  // the data set of sequence g given counts_ before it
  void advance();                 // takes sequence next_ into counts_
  std::vector<double> weights_;
  int64_t next_ = 0;                          // the counts_ are those before sequence next_
  std::vector<int64_t> counts_;               // per data set
  std::vector<std::vector<int64_t>> blocks_;  // counts_ before sequence b * kBlock
};

}  // namespace tessel::data
