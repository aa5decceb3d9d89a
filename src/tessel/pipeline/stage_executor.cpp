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

// Tag = 2 * (micro mod 2^14) + kind: below 32767, the smallest tag bound MPI guarantees.
// Messages between two stages also arrive in micro-batch order (MPI does not overtake), so
// the wrap-around is harmless.
enum class Msg : int { activation = 0, gradient = 1 };
constexpr int64_t kTagMicros = int64_t(1) << 14;
int tag(Msg kind, int64_t micro) {
  return int(2 * (micro % kTagMicros) + int(kind));
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
  int64_t micro = -1;
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
        last_(group.rank() == group.size() - 1),
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
      const Op global{op.kind, op.micro + first_micro_, op.chunk};
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
    int source;       // -1: this stage receives nothing of this kind
    size_t scan = 0;  // next op of the list to look at for a receive to post
    std::deque<Transfer> posted;
  };

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
    if (in.source < 0) return;
    BufferPool& pool = in.kind == Msg::activation ? upstream_ : downstream_;
    while (in.posted.size() < kReceivesAhead && in.scan < ops_.size()) {
      const Op& op = ops_[in.scan++];
      if (op.kind != in.consumer) continue;
      Transfer t{op.micro + first_micro_, pool.take(), &pool, {}};
      t.request = group_.irecv(t.data, in.source, tag(in.kind, t.micro));
      in.posted.push_back(std::move(t));
    }
  }

  // Waits for the message of `micro`, then posts the next receive before the op computes.
  Transfer receive(Inbox& in, int64_t micro) {
    TESSEL_CHECK(!in.posted.empty() && in.posted.front().micro == micro, "pipeline stage ", stage_,
                 ": no receive posted for micro-batch ", micro);
    Transfer t = std::move(in.posted.front());
    in.posted.pop_front();
    const double start = now_seconds();
    t.request.wait();
    stats_.wait_seconds += now_seconds() - start;
    post_ahead(in);
    return t;
  }

  // Starts sending `data`, kept alive until the send completes; recycles finished sends.
  void send(std::vector<float> data, BufferPool& pool, Msg kind, int dest, int64_t micro) {
    Transfer t{micro, std::move(data), &pool, {}};
    t.request = group_.isend(t.data, dest, tag(kind, micro));
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
    const int64_t micro = op.micro;
    Transfer input = stage_ > 0 ? receive(activations_, micro) : Transfer{};
    std::vector<float> output = last_ ? std::vector<float>{} : downstream_.take();
    timed(op, stats_.forward_seconds, [&] { work_.forward(op.chunk, micro, input.data, output); });
    if (input.pool) input.pool->give(std::move(input.data));
    if (!last_) send(std::move(output), downstream_, Msg::activation, stage_ + 1, micro);
    saved_versions_.push_back(version_);
    ++stats_.forwards;
    stats_.peak_live_activations = std::max(stats_.peak_live_activations, ++live_);
  }

  void backward(const Op& op) {
    const int64_t micro = op.micro;
    Transfer output_grad = last_ ? Transfer{} : receive(gradients_, micro);
    std::vector<float> input_grad = stage_ > 0 ? upstream_.take() : std::vector<float>{};
    timed(op, stats_.backward_seconds, [&] {
      if (split_)
        work_.backward_input(op.chunk, micro, output_grad.data, input_grad);
      else
        work_.backward(op.chunk, micro, output_grad.data, input_grad);
    });
    if (output_grad.pool) output_grad.pool->give(std::move(output_grad.data));
    if (stage_ > 0) send(std::move(input_grad), upstream_, Msg::gradient, stage_ - 1, micro);
    // Backwards run in forward order, so the oldest saved version is this micro-batch's.
    const int64_t gap = version_ - saved_versions_.front();
    saved_versions_.pop_front();
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
  const int stage_;
  const bool last_;
  const std::vector<Op> ops_;
  const bool split_;  // ZB-H1: backward_input for B ops, backward_weights for W ops
  const int64_t first_micro_;
  // Buffers of the messages exchanged with the previous stage (activations in, gradients
  // out) and with the next (activations out, gradients in).
  BufferPool upstream_, downstream_;
  Inbox activations_{Msg::activation, OpKind::forward, stage_ > 0 ? stage_ - 1 : -1, 0, {}};
  Inbox gradients_{Msg::gradient, OpKind::backward, last_ ? -1 : stage_ + 1, 0, {}};
  std::vector<Transfer> sends_;
  std::deque<int64_t> saved_versions_;  // version of each forward awaiting its backward
  int64_t live_ = 0;   // forwards whose activations are kept: until the backward (ZB-H1: W)
  double origin_ = 0;  // the monotonic-clock time that the timeline counts from
  StageStats stats_;
};

}  // namespace

StageCosts StageStats::profiled_costs() const {
  auto mean = [](double seconds, int64_t n) { return n > 0 ? seconds / double(n) : 0.0; };
  const double weight = mean(weight_seconds, weights);
  return {mean(forward_seconds, forwards), mean(backward_seconds, backwards) + weight,
          mean(step_seconds, steps), weight};
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
  if (schedule.chunks > 1)
    input_error("pipeline: the stage executor does not run interleaved schedules yet");
  if (first_micro < 0) input_error("pipeline: first_micro must be >= 0, got ", first_micro);
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
  std::map<std::tuple<int, OpKind, int64_t>, double> ends;
  for (const OpTiming& t : timeline) ends[{t.stage, t.op.kind, t.op.micro}] = t.end;
  std::vector<double> free_at(size_t(stages), 0);  // end of each stage's previous op
  double sum = 0;
  int64_t waited = 0;
  for (const OpTiming& t : timeline) {
    const int from = t.op.kind == OpKind::forward ? t.stage - 1 : t.stage + 1;
    const bool message = t.op.kind == OpKind::forward || t.op.kind == OpKind::backward;
    if (message && from >= 0 && from < stages) {
      const double sent = ends.at({from, t.op.kind, t.op.micro});
      if (sent > free_at[size_t(t.stage)]) {
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
