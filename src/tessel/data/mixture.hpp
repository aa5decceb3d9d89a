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
#include <span>
#include <vector>

namespace tessel::data {

// The smallest share a data set of a mixture may have (data.weights, checked with the config):
// fewer than one sequence in a million would leave it all but unread, as a weight of 0 would.
inline constexpr double kMinShare = 1e-6;

// `weights` divided by their sum: the one place shares are normalized, so the run and `tessel
// eval` weight with the same rounded shares. InputError unless there is at least one and each
// is positive and finite.
std::vector<double> normalized_weights(std::vector<double> weights);

class MixtureOrder {
 public:
  // `weights`: one share per data set, as normalized_weights takes them.
  explicit MixtureOrder(std::vector<double> weights);

  struct Slot {
    int64_t source = 0;  // the data set
    int64_t index = 0;   // its sequence number within that data set
    bool operator==(const Slot&) const = default;
  };
  // Global sequence g >= 0. O(data sets) per call for increasing g; a jump back costs at most
  // kBlock steps from the nearest remembered block start. The first call at a large g (a
  // resumed run) walks the order from 0: O(g * data sets), once.
  Slot locate(int64_t g);

  const std::vector<double>& weights() const { return weights_; }  // normalized, sum 1
  int64_t sources() const { return int64_t(weights_.size()); }

 private:
  static constexpr int64_t kBlock = 1024;
  int64_t advance();  // takes sequence next_ into counts_; returns its data set
  std::vector<double> weights_;
  int64_t next_ = 0;             // the counts_ are those before sequence next_
  std::vector<int64_t> counts_;  // per data set
  // counts_ before sequence b * kBlock: data set d's at [b * sources() + d]
  std::vector<int64_t> blocks_;
};

// Σ weights[d] · values[d] in data set order: a mixture's loss from its data sets' losses.
// One compiled function, so the run's validation and `tessel eval` round it alike.
double mixture_mean(std::span<const double> weights, std::span<const double> values);

}  // namespace tessel::data
