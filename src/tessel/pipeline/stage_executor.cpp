#include "tessel/pipeline/stage_executor.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <deque>
#include <iterator>
#include <map>
#include <numeric>
#include <tuple>

#include "tessel/core/error.hpp"
#include "tessel/core/timer.hpp"

namespace tessel::pipeline {

namespace {

// Tag = 2 * ((micro v + chunk) mod 2^14) + kind, with v chunks per stage: at most 32767, the
// smallest tag bound MPI guarantees. The messages of one kind from one stage to another are
// sent in the order the receiver consumes them (the lists number both stages' ops alike) and
// MPI does not overtake, so the wrap-around is harmless.
enum class Msg : int { activation = 0, gradient = 1 };
constexpr int64_t kTagSlots = int64_t(1) << 14;
int tag(Msg kind, const Op& op, int chunks) {
  const int64_t t = 2 * ((op.micro * chunks + op.chunk) % kTagSlots) + int(kind);
  TESSEL_CHECK(t >= 0 && t < 2 * kTagSlots, "pipeline tag ", t, " of micro-batch ", op.micro);
  return int(t);
}

// Receives posted per direction ahead of the op that consumes them ("double-buffered"): a
// message mostly finds its receive posted while the receiver still computes earlier ops.
constexpr size_t kReceivesAhead = 2;

// Buffers of one message size, recycled once their transfer has completed.
class BufferPool {
 public:
  explicit BufferPool(size_t elems) : elems_(elems) {}
  std::vector<float> take() {
    if (free_.empty()) return std::vector<float>(elems_);
    std::vector<float> b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void give(std::vector<float> b) { free_.push_back(std::move(b)); }

 private:
  size_t elems_;
  std::vector<std::vector<float>> free_;
};

// A message buffer and its request: a posted receive or a send in flight.
struct Transfer {
  Op op{OpKind::forward};  // the op that sends or consumes it (global micro-batch number)
  std::vector<float> data;
  BufferPool* pool = nullptr;  // where `data` goes back once the transfer is done
  comm::Request request;
};

// One stage's pass over its instruction list.
class StageRun {
 public:
  StageRun(comm::Communicator& group, StageWork& work, const ExecutorOptions& options, Rng& delays,
           int64_t& version, const ScheduleOptions& schedule, int64_t first_micro)
      : group_(group),
        work_(work),
        options_(options),
        delays_(delays),
        version_(version),
        stage_(group.rank()),
        stages_(group.size()),
        chunks_(schedule.chunks),
        ops_(stage_ops(schedule, group.rank())),
        split_(schedule.kind == ScheduleKind::zb_h1),
        first_micro_(first_micro),
        upstream_(work.input_elems()),
        downstream_(work.output_elems()) {}

  StageStats run() {
    try {
      return run_list();
    } catch (...) {
      abandon_messages();
      throw;
    }
  }

 private:
  StageStats run_list() {
    group_.barrier();
    const double start = now_seconds();
    set_timeline_origin(start);
    post_ahead(activations_);
    post_ahead(gradients_);
    for (const Op& op : ops_) {
      delay();
      const Op global = offset(op);
      if (op.kind == OpKind::forward)
        forward(global);
      else if (op.kind == OpKind::backward)
        backward(global);
      else if (op.kind == OpKind::weight)
        weight(global);
      else
        step();
    }
    const double wait_start = now_seconds();
    for (Transfer& t : sends_) t.request.wait();
    stats_.wait_seconds += now_seconds() - wait_start;
    TESSEL_CHECK(saved_versions_.empty() && live_ == 0, "pipeline stage ", stage_, ": ",
                 saved_versions_.size(), " forwards without their backward, ", live_,
                 " without releasing their activations");
    stats_.chunks = chunks_;
    stats_.total_seconds = now_seconds() - start;
    return std::move(stats_);
  }

  // After an error the messages in flight are not awaited: a peer may never send or receive
  // them, and waiting would keep the error from its caller, who has to end the job. They are
  // leaked, buffers included, since MPI may still write into a posted receive.
  void abandon_messages() {
    auto* abandoned = new std::vector<Transfer>;
    for (std::deque<Transfer>* in : {&activations_.posted, &gradients_.posted})
      std::move(in->begin(), in->end(), std::back_inserter(*abandoned));
    std::move(sends_.begin(), sends_.end(), std::back_inserter(*abandoned));
  }

  // The receives of one direction, posted in list order ahead of their consumers.
  struct Inbox {
    Msg kind;
    OpKind consumer;
    int source;
    size_t scan = 0;  // next op of the list to look at for a receive to post
    std::deque<Transfer> posted;
  };

  // Op numbered from the run's first micro-batch.
  Op offset(const Op& op) const { return {op.kind, op.micro + first_micro_, op.chunk}; }
  // The model's piece that `op` runs: virtual stage chunk P + s of v P.
  int piece(const Op& op) const { return virtual_stage(op, stage_, stages_); }
  bool first_piece(const Op& op) const { return piece(op) == 0; }
  bool last_piece(const Op& op) const { return piece(op) == stages_ * chunks_ - 1; }
  // A forward receives activations except on the model's first piece, a backward gradients
  // except on its last.
  bool receives(const Op& op, OpKind consumer) const {
    return op.kind == consumer &&
           (consumer == OpKind::forward ? !first_piece(op) : !last_piece(op));
  }

  // The timeline origin is stage 0's leaving the barrier, read on the system clock: ranks
  // leave a barrier milliseconds apart on a loaded machine, while one machine's system clock
  // is the same in every process (and NTP keeps machines close). Durations stay on the
  // monotonic clock.
  void set_timeline_origin(double steady_now) {
    const double wall_now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    double stage0_wall = wall_now;
    group_.broadcast(std::span(&stage0_wall, 1), 0);
    origin_ = steady_now - (wall_now - stage0_wall);
  }

  void post_ahead(Inbox& in) {
    BufferPool& pool = in.kind == Msg::activation ? upstream_ : downstream_;
    while (in.posted.size() < kReceivesAhead && in.scan < ops_.size()) {
      const Op& op = ops_[in.scan++];
      if (!receives(op, in.consumer)) continue;
      Transfer t{offset(op), pool.take(), &pool, {}};
      t.request = group_.irecv(t.data, in.source, tag(in.kind, t.op, chunks_));
      in.posted.push_back(std::move(t));
    }
  }

  // Waits for the message of `op`, then posts the next receive before the op computes.
  Transfer receive(Inbox& in, const Op& op) {
    TESSEL_CHECK(!in.posted.empty() && in.posted.front().op == op, "pipeline stage ", stage_,
                 ": no receive posted for micro-batch ", op.micro, " chunk ", op.chunk);
    Transfer t = std::move(in.posted.front());
    in.posted.pop_front();
    const double start = now_seconds();
    t.request.wait();
    stats_.wait_seconds += now_seconds() - start;
    post_ahead(in);
    return t;
  }

  // Starts sending `data`, kept alive until the send completes; recycles finished sends.
  // To the op that consumes it: the next piece's forward (activations) or the previous
  // piece's backward (gradients), on stage piece mod P.
  void send(std::vector<float> data, BufferPool& pool, Msg kind, const Op& op) {
    const int to = piece(op) + (kind == Msg::activation ? 1 : -1);
    const Op consumer{op.kind, op.micro, to / stages_};
    Transfer t{op, std::move(data), &pool, {}};
    t.request = group_.isend(t.data, to % stages_, tag(kind, consumer, chunks_));
    sends_.push_back(std::move(t));
    std::erase_if(sends_, [](Transfer& sent) {
      if (!sent.request.test()) return false;
      sent.pool->give(std::move(sent.data));
      return true;
    });
  }

  // Spins: a sleep lasts at least the kernel's timer slack (~50 us) and a yield may hand the
  // core away for a whole time slice on a loaded machine, far beyond a few microseconds.
  void delay() {
    if (options_.max_random_delay_us <= 0) return;
    const double until =
        now_seconds() + 1e-6 * double(delays_.uniform()) * options_.max_random_delay_us;
    while (now_seconds() < until) {
    }
  }

  // Times `compute` into `seconds` and the timeline.
  template <class F>
  void timed(Op op, double& seconds, F&& compute) {
    const double start = now_seconds();
    compute();
    const double end = now_seconds();
    seconds += end - start;
    if (options_.record_timeline)
      stats_.timeline.push_back({stage_, op, start - origin_, end - origin_});
  }

  void forward(const Op& op) {
    Transfer input = first_piece(op) ? Transfer{} : receive(activations_, op);
    std::vector<float> output = last_piece(op) ? std::vector<float>{} : downstream_.take();
    timed(op, stats_.forward_seconds,
          [&] { work_.forward(op.chunk, op.micro, input.data, output); });
    if (input.pool) input.pool->give(std::move(input.data));
    if (!last_piece(op)) send(std::move(output), downstream_, Msg::activation, op);
    saved_versions_[{op.micro, op.chunk}] = version_;
    ++stats_.forwards;
    stats_.peak_live_activations = std::max(stats_.peak_live_activations, ++live_);
  }

  void backward(const Op& op) {
    Transfer output_grad = last_piece(op) ? Transfer{} : receive(gradients_, op);
    std::vector<float> input_grad = first_piece(op) ? std::vector<float>{} : upstream_.take();
    timed(op, stats_.backward_seconds, [&] {
      if (split_)
        work_.backward_input(op.chunk, op.micro, output_grad.data, input_grad);
      else
        work_.backward(op.chunk, op.micro, output_grad.data, input_grad);
    });
    if (output_grad.pool) output_grad.pool->give(std::move(output_grad.data));
    if (!first_piece(op)) send(std::move(input_grad), upstream_, Msg::gradient, op);
    const auto saved = saved_versions_.find({op.micro, op.chunk});
    const int64_t gap = version_ - saved->second;
    saved_versions_.erase(saved);
    live_ -= !split_;  // ZB-H1: the W releases the activations
    ++stats_.backwards;
    stats_.backward_versions.push_back(version_);
    stats_.max_version_gap = std::max(stats_.max_version_gap, gap);
    stats_.inconsistent_backwards += gap != 0;
    if (stats_.gap_histogram.size() <= size_t(gap)) stats_.gap_histogram.resize(size_t(gap) + 1);
    ++stats_.gap_histogram[size_t(gap)];
  }

  void weight(const Op& op) {
    timed(op, stats_.weight_seconds, [&] { work_.backward_weights(op.chunk, op.micro); });
    --live_;
    ++stats_.weights;
  }

  void step() {
    timed({OpKind::step}, stats_.step_seconds, [&] { work_.step(version_); });
    ++version_;
    ++stats_.steps;
  }

  comm::Communicator& group_;
  StageWork& work_;
  const ExecutorOptions& options_;
  Rng& delays_;
  int64_t& version_;
  const int stage_, stages_;
  const int chunks_;  // v: the model's pieces are virtual stages 0 .. v P - 1
  const std::vector<Op> ops_;
  const bool split_;  // ZB-H1: backward_input for B ops, backward_weights for W ops
  const int64_t first_micro_;
  // Buffers of the messages exchanged with the previous stage (activations in, gradients
  // out) and with the next (activations out, gradients in); with v > 1 the stages form a
  // ring.
  BufferPool upstream_, downstream_;
  Inbox activations_{Msg::activation, OpKind::forward, (stage_ + stages_ - 1) % stages_, 0, {}};
  Inbox gradients_{Msg::gradient, OpKind::backward, (stage_ + 1) % stages_, 0, {}};
  std::vector<Transfer> sends_;
  // Version of each (micro-batch, chunk) forward awaiting its backward.
  std::map<std::pair<int64_t, int>, int64_t> saved_versions_;
  int64_t live_ = 0;   // forwards whose activations are kept: until the backward (ZB-H1: W)
  double origin_ = 0;  // the monotonic-clock time that the timeline counts from
  StageStats stats_;
};

}  // namespace

StageCosts StageStats::profiled_costs() const {
  auto mean = [](double seconds, int64_t n) { return n > 0 ? seconds / double(n) : 0.0; };
  // A micro-batch's work on the stage is v chunk ops.
  const double weight = chunks * mean(weight_seconds, weights);
  return {chunks * mean(forward_seconds, forwards),
          chunks * mean(backward_seconds, backwards) + weight, mean(step_seconds, steps), weight};
}

StageExecutor::StageExecutor(comm::Communicator& pp_group, StageWork& work, ExecutorOptions options)
    : group_(pp_group),
      work_(work),
      options_(options),
      delays_(options.delay_seed ^ (uint64_t(pp_group.rank()) * 0x9E3779B97F4A7C15ULL)) {
  const int P = pp_group.size();
  const std::array<int64_t, 3> mine{int64_t(work.input_elems()), int64_t(work.output_elems()),
                                    int64_t(work.chunks())};
  std::vector<int64_t> all(mine.size() * size_t(P));
  pp_group.all_gather(mine, all);
  // Every stage sees every size, so all throw the same error together.
  auto in = [&](int s) { return all[mine.size() * size_t(s)]; };
  auto out = [&](int s) { return all[mine.size() * size_t(s) + 1]; };
  auto chunks = [&](int s) { return all[mine.size() * size_t(s) + 2]; };
  for (int s = 0; s < P; ++s)
    if (chunks(s) != chunks(0) || chunks(s) < 1)
      input_error(
          "pipeline: every stage must hold the same number (>= 1) of model chunks, but "
          "stage 0 holds ",
          chunks(0), " and stage ", s, " ", chunks(s));
  // With several chunks the messages run round a ring: the last stage feeds stage 0.
  const bool ring = chunks(0) > 1;
  if (!ring && in(0) != 0)
    input_error("pipeline: stage 0 receives no activations but its input_elems() is ", in(0));
  if (!ring && out(P - 1) != 0)
    input_error("pipeline: the last stage ", P - 1,
                " sends no activations but its output_elems() is ", out(P - 1));
  for (int s = 0; s + 1 < P || (ring && s < P); ++s)
    if (out(s) != in((s + 1) % P))
      input_error("pipeline: stage ", s, " sends ", out(s), " elements per micro-batch but stage ",
                  (s + 1) % P, " expects ", in((s + 1) % P));
}

StageStats StageExecutor::run(const ScheduleOptions& schedule, int64_t first_micro) {
  if (schedule.stages != group_.size())
    input_error("pipeline: the schedule has ", schedule.stages, " stages but the pp group has ",
                group_.size(), " ranks");
  if (schedule.chunks != work_.chunks())
    input_error("pipeline: the schedule has ", schedule.chunks, " chunks per stage but the stage ",
                "holds ", work_.chunks());
  if (first_micro < 0) input_error("pipeline: first_micro must be >= 0, got ", first_micro);
  // Each run counts the backwards towards PACI's next local STEP afresh: a horizon that is no
  // multiple of K would leave its last backwards' gradients to the next run's first STEP.
  if (schedule.kind == ScheduleKind::paci && schedule.paci_k >= 1 &&
      schedule.micro_batches % schedule.paci_k != 0)
    input_error("pipeline: a PACI run's horizon of ", schedule.micro_batches,
                " micro-batches must be a multiple of paci_k = ", schedule.paci_k,
                " (each run ends with a local step)");
  return StageRun(group_, work_, options_, delays_, version_, schedule, first_micro).run();
}

std::vector<OpTiming> gather_timeline(comm::Communicator& pp_group, const StageStats& stats) {
  // Each op as five doubles (kind, micro, chunk, start, end); micro-batch numbers stay exact.
  constexpr size_t kFields = 5;
  std::vector<double> mine;
  for (const OpTiming& t : stats.timeline)
    mine.insert(mine.end(),
                {double(int(t.op.kind)), double(t.op.micro), double(t.op.chunk), t.start, t.end});
  const int64_t count = int64_t(mine.size());
  std::vector<int64_t> counts(size_t(pp_group.size()));
  pp_group.all_gather(std::span(&count, 1), counts);
  const std::vector<size_t> sizes(counts.begin(), counts.end());
  std::vector<double> all(std::accumulate(sizes.begin(), sizes.end(), size_t(0)));
  pp_group.all_gatherv(mine, all, sizes);
  std::vector<OpTiming> timeline;
  if (pp_group.rank() != 0) return timeline;
  size_t at = 0;
  for (int s = 0; s < pp_group.size(); ++s)
    for (size_t i = 0; i < sizes[size_t(s)]; i += kFields, at += kFields)
      timeline.push_back({s,
                          {OpKind(int(all[at])), int64_t(all[at + 1]), int(all[at + 2])},
                          all[at + 3],
                          all[at + 4]});
  return timeline;
}

double profiled_link_latency(const std::vector<OpTiming>& timeline, int stages) {
  // (virtual stage chunk P + s, kind, micro-batch) -> end
  std::map<std::tuple<int, OpKind, int64_t>, double> ends;
  for (const OpTiming& t : timeline)
    ends[{virtual_stage(t.op, t.stage, stages), t.op.kind, t.op.micro}] = t.end;
  std::vector<double> free_at(size_t(stages), 0);  // end of each stage's previous op
  double sum = 0;
  int64_t waited = 0;
  for (const OpTiming& t : timeline) {
    const int piece = virtual_stage(t.op, t.stage, stages);
    const int from = t.op.kind == OpKind::forward ? piece - 1 : piece + 1;
    const bool message = t.op.kind == OpKind::forward || t.op.kind == OpKind::backward;
    // No producer past the model's ends (virtual stage -1, or v P).
    const auto producer = ends.find({from, t.op.kind, t.op.micro});
    if (message && producer != ends.end()) {
      const double sent = producer->second;
      // At or after: with one stage and v chunks the producer is the consumer's previous op.
      if (sent >= free_at[size_t(t.stage)]) {
        sum += t.start - sent;
        ++waited;
      }
    }
    free_at[size_t(t.stage)] = t.end;
  }
  return waited > 0 ? sum / double(waited) : 0;
}

nlohmann::json gather_chrome_trace(comm::Communicator& pp_group, const StageStats& stats) {
  const std::vector<OpTiming> timeline = gather_timeline(pp_group, stats);
  if (pp_group.rank() != 0) return nlohmann::json::object();
  return chrome_trace(timeline, pp_group.size(), 1e6);
}

}  // namespace tessel::pipeline
