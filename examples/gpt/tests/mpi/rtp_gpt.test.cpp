// SPDX-License-Identifier: Apache-2.0
// The whole GPT under RTP (rtp_gpt.hpp) over MPI ranks (processes), the world as the ring, with
// the collective-sequence check on: 10 SGD iterations and 3 clipped AdamW steps (`rtp_gpt::step`),
// an evaluation after each, then the next-token probabilities. The code is rtp_model.test.cpp's
// (rtp_model_support.hpp's `train_rank`, generic over the Communicator). Registered at 2 and 4
// ranks (mpi_rtp_gpt_np2, mpi_rtp_gpt_np4).
//
// Every process also runs an in-process group of the same N (threads) and keeps its own rank's
// record, as tests/mpi/rtp.test.cpp does for the MLP (and for the same reasons: nothing of the
// expected bits travels through the communicator under test, and every process computes): this
// rank's elements of the model (its shards and the replicas) after every step, their gradients,
// its Adam moments, the norms and clipping factors `step` reported, the losses and evaluation
// losses and the probabilities must be the same bits over MPI and in-process. The run assembled
// from every rank's records (an allgather) is the in-process run, passes the unit test's checks
// against the serial model in fp32 and float64, and its AdamW gradients have the norms `step`
// reported (every shard and every replica counted once).
//
// Faults: a bad token or target on one rank (a config_error there before the call's first
// collective), a micro-batch count of 0 to one rank's `step` (a config_error before the norm's
// all-reduce), and a ring shift failing on one rank (a test-double communicator: at the call, or in
// flight) end every rank with communication_error naming the mismatched calls, within seconds.
#include "rtp_model_support.hpp"

#include <chunkstar/mpi/mpi_communicator.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

using namespace chunkstar;
using namespace gpt::testing::rtp_model;

namespace rtp_gpt_test {

namespace {

constexpr int adam_steps = 3;

inline constexpr std::size_t whole_run = SIZE_MAX;  // a field of the run, not of one step (losses: element = step)

/** Calls `f(name, step or whole_run, std::span(field)...)` for every field of the records @p r (one
 *  for packing, two for comparing), in one fixed order. */
template <class F, class... R>
void fields(F&& f, R&... r) {
  const auto per_step = [&](const char* name, auto member) {
    const std::size_t steps = std::min({(r.*member).size()...});
    for (std::size_t i = 0; i < steps; ++i) f(name, i, std::span((r.*member)[i])...);
  };
  const auto once = [&](const char* name, auto member) { f(name, whole_run, std::span(r.*member)...); };
  once("initial parameters", &rank_record::initial);
  per_step("parameters after the SGD step", &rank_record::params);
  per_step("gradients of the SGD step", &rank_record::grads);
  once("training losses", &rank_record::train_loss);
  once("evaluation losses", &rank_record::eval_loss);
  f("evaluations that displaced a shard", whole_run, std::span(&r.eval_displaced, 1)...);
  per_step("parameters after the AdamW step", &rank_record::adam_params);
  per_step("gradients of the AdamW step", &rank_record::adam_grads);
  per_step("Adam moments m | v", &rank_record::adam_moments);
  once("AdamW training losses", &rank_record::adam_train_loss);
  once("AdamW evaluation losses", &rank_record::adam_eval_loss);
  once("gradient norms step() reported", &rank_record::grad_norm);
  once("clipping factors step() reported", &rank_record::clip_scale);
  once("next-token probabilities", &rank_record::probs);
}

/** The record's bytes, field after field (every rank's record has the same shape). */
std::vector<std::byte> pack(const rank_record& rec) {
  std::vector<std::byte> out;
  fields(
      [&](const char*, std::size_t, auto s) {
        const auto b = std::as_bytes(s);
        out.insert(out.end(), b.begin(), b.end());
      },
      rec);
  return out;
}

/** The record packed in @p bytes, whose shape is @p shape's. */
rank_record unpack(std::span<const std::byte> bytes, const rank_record& shape) {
  rank_record rec = shape;
  std::size_t at = 0;
  fields(
      [&](const char*, std::size_t, auto s) {
        if (s.empty()) return;  // data() may be null
        std::memcpy(s.data(), bytes.data() + at, s.size_bytes());
        at += s.size_bytes();
      },
      rec);
  return rec;
}

/** Where @p got (this MPI rank) and @p want (the same rank in-process) differ in any bit: one line
 *  per differing field and step, naming the first differing element. */
std::vector<std::string> bit_differences(const rank_record& got, const rank_record& want) {
  std::vector<std::string> out;
  if (pack(got).size() != pack(want).size()) out.push_back("the records have different shapes (steps or sizes)");
  fields(
      [&](const char* name, std::size_t step, auto x, auto y) {
        if (x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size_bytes()) == 0)) return;
        std::ostringstream line;
        line << name;
        if (step != whole_run) line << " (step " << step << ")";
        std::size_t i = 0;
        while (i < std::min(x.size(), y.size()) && std::memcmp(&x[i], &y[i], sizeof x[i]) == 0) ++i;
        if (i < std::min(x.size(), y.size()))
          line << "[" << i << "] is " << std::hexfloat << static_cast<double>(x[i]) << " over MPI, "
               << static_cast<double>(y[i]) << " in-process";
        else line << " has " << x.size() << " elements over MPI, " << y.size() << " in-process";
        out.push_back(line.str());
      },
      got, want);
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

/** A communicator that forwards to @p Inner, except that the `at`-th ring shift after `arm`
 *  fails: at the call (nothing is issued, as when the transport refuses it) or in flight (issued
 *  and completed, then reported failed by `wait`). A test double for a failure inside a pass,
 *  where rtp_gpt's own inputs cannot make one. */
template <Communicator Inner>
class failing_ring {
 public:
  explicit failing_ring(Inner& inner) : inner_(inner) {}

  void arm(int at, bool in_flight) { armed_ = true, countdown_ = at, in_flight_ = in_flight; }
  void disarm() { armed_ = false; }
  [[nodiscard]] bool fired() const { return fired_; }

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  void allreduce(void* p, std::size_t n, dtype t, reduce_op op) { inner_.allreduce(p, n, t, op); }
  void allreduce(std::span<double> d, reduce_op op) { inner_.allreduce(d, op); }
  void allgather(const void* s, void* r, std::size_t n) { inner_.allgather(s, r, n); }
  void reduce_scatter(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    inner_.reduce_scatter(s, r, n, t, op);
  }
  void reduce(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    inner_.reduce(s, r, n, t, op, root);
  }
  void broadcast(void* p, std::size_t n, int root) { inner_.broadcast(p, n, root); }
  void ring_shift(const void* s, void* r, std::size_t n) { ring_shift_async(s, r, n).wait(); }
  void barrier() { inner_.barrier(); }
  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) {
    return inner_.allreduce_async(p, n, t, op);
  }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return inner_.allreduce_async(d, op); }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) { return inner_.allgather_async(s, r, n); }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    return inner_.reduce_scatter_async(s, r, n, t, op);
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    return inner_.reduce_async(s, r, n, t, op, root);
  }
  comm_handle broadcast_async(void* p, std::size_t n, int root) { return inner_.broadcast_async(p, n, root); }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) {
    if (!armed_ || countdown_-- > 0) return inner_.ring_shift_async(s, r, n);
    armed_ = false;
    fired_ = true;
    if (!in_flight_) throw communication_error("injected: a ring shift failed at the call");
    return comm_handle(std::make_shared<failed_in_flight>(inner_.ring_shift_async(s, r, n)));
  }

 private:
  struct failed_in_flight {
    comm_handle inner;
    explicit failed_in_flight(comm_handle h) : inner(std::move(h)) {}
    void wait() {
      inner.wait();  // the buffers are MPI's until the transfer completes
      throw communication_error("injected: a ring shift failed in flight");
    }
    bool ready() { return inner.ready(); }
  };

  Inner& inner_;
  bool armed_ = false, in_flight_ = false, fired_ = false;
  int countdown_ = 0;
};
static_assert(Communicator<failing_ring<mpi_communicator>>);

}  // namespace

TEST_CASE(
    "whole GPT under RTP on MPI ranks: the bits of the same rank in-process, every step, and the serial model's "
    "tolerance") {
  mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = true});
  REQUIRE(comm.checks_sequence());
  const int n = comm.size(), me = comm.rank();

  auto start = std::chrono::steady_clock::now();
  const rank_record mine = train_rank(comm, iterations, adam_steps);
  const double mpi_seconds = seconds_since(start);
  start = std::chrono::steady_clock::now();
  const std::vector<rank_record> threads = run_rtp(n, iterations, adam_steps);
  const double in_process_seconds = seconds_since(start);
  const rank_record& same_rank = threads[static_cast<std::size_t>(me)];
  const std::vector<std::string> diffs = bit_differences(mine, same_rank);
  for (const std::string& line : diffs) FAIL_CHECK("rank " << me << ", " << line);
  CHECK(diffs.empty());
  {  // the comparison sees one ulp of one owned gradient element at the last step
    rank_record nudged = same_rank;
    flat& g = nudged.adam_grads.back();
    float& x = *std::find_if(g.begin(), g.end(), [](float v) { return v != 0.0f; });
    x = std::nextafter(x, std::numeric_limits<float>::infinity());
    CHECK(bit_differences(mine, nudged).size() == 1);
  }
  CHECK(mine.eval_displaced == 0);
  for (const float c : mine.clip_scale)
    CHECK(c < 1.0f);  // max_norm is below the gradients' norms: clipping is exercised

  // The whole MPI run, from every rank's record, against the in-process run and the serial model
  // (rank 0 checks: pure computation on the gathered records, and one report is enough).
  const std::vector<std::byte> bytes = pack(mine);
  std::vector<std::byte> all(bytes.size() * static_cast<std::size_t>(n));
  comm.allgather(bytes.data(), all.data(), bytes.size());
  if (me != 0) return;
  start = std::chrono::steady_clock::now();
  std::vector<rank_record> ranks;
  for (int r = 0; r < n; ++r)
    ranks.push_back(unpack(
        std::span<const std::byte>(all).subspan(static_cast<std::size_t>(r) * bytes.size(), bytes.size()), mine));
  CHECK(same_bits(ranks, threads));
  check_against_serial(ranks, n);
  // AdamW: the norm step() reported (the same on every rank) is the assembled gradient's.
  for (std::size_t s = 0; s < static_cast<std::size_t>(adam_steps); ++s) {
    CAPTURE(s);
    double sq = 0;
    for (const float g : assemble(ranks, &rank_record::adam_grads, s)) sq += static_cast<double>(g) * g;
    for (const auto& r : ranks) CHECK(r.grad_norm[s] == mine.grad_norm[s]);
    CHECK(std::abs(mine.grad_norm[s] - std::sqrt(sq)) <= 1e-9 * std::sqrt(sq));
    CHECK(mine.clip_scale[s] == doctest::Approx(max_norm / (std::sqrt(sq) + 1e-6)).epsilon(1e-6));
  }
  MESSAGE("N = " << n << ": training over MPI " << mpi_seconds << " s, in-process " << in_process_seconds
                 << " s, checks against the serial model " << seconds_since(start) << " s; AdamW gradient norms "
                 << mine.grad_norm.front() << " -> " << mine.grad_norm.back() << ", evaluation loss "
                 << mine.adam_eval_loss.back());
}

TEST_CASE(
    "whole GPT under RTP on MPI ranks: a bad input or a failing shift on one rank gives every rank communication_error "
    "within seconds, not a hang") {
  // MPI cannot tell the peers that a rank left the schedule: they would wait in their next
  // collective for ever. With the collective-sequence check, the failing rank's next collective
  // (a barrier, its "I failed" to the others) differs from the peers' (a shift or an all-reduce),
  // so every rank, the failing one included, gets communication_error naming both at that call.
  // A bad step argument (micro-batches 0 on one rank) is caught earlier: the step compares its
  // arguments across the ranks first, and every rank gets the same config_error naming it.
  enum class fault { bad_token, bad_target, no_micro_batches, shift_at_call, shift_in_flight };
  struct fault_case {
    fault kind;
    int rank, iteration;
    stage where;
    int shift;              // for the shift faults: which one after the call starts (0-based)
    const char* own_error;  // what the failing rank's own error says
    const char* peer_call;  // what the peers were calling
    bool everyone = false;  // a step argument the ranks compare (step_agreement): config_error on all
  };
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int shifts_per_pass = world - 1;  // per rotation: N - 1 in forward, 2(N - 1) in backward
  const fault_case cases[] = {
      {fault::bad_token, world - 1, 3, stage::train_forward, 0, "tokens[5] = 50 is outside the vocabulary",
       "ring_shift"},
      {fault::bad_target, 0, 6, stage::eval, 0, "targets[11] = -1 is outside the vocabulary", "ring_shift"},
      // backward's first shift (the head's first fetch), and its last (the embedding gradient's
      // last partial sum; six rotations of 2(N - 1) shifts each)
      {fault::shift_at_call, 1, 2, stage::backward, 0, "injected", "ring_shift"},
      {fault::shift_at_call, 0, 5, stage::backward, 12 * shifts_per_pass - 1, "injected", "ring_shift"},
      // the second AdamW iteration's forward, block 1's attention's first shift
      {fault::shift_in_flight, world - 1, iterations + 1, stage::train_forward, 3 * shifts_per_pass, "injected",
       "ring_shift"},
      // the step compares its arguments across the ranks first: every rank stops with the same error
      {fault::no_micro_batches, 1, iterations, stage::step, 0, "but rank 1 passes micro_batches 0", "", true},
  };
  for (const fault_case& f : cases) {
    CAPTURE(static_cast<int>(f.kind));
    CAPTURE(f.rank);
    CAPTURE(f.iteration);
    mpi_communicator mpi(MPI_COMM_WORLD, {.check_sequence = true});  // a fresh one: a mismatch poisons it for good
    failing_ring<mpi_communicator> ring(mpi);
    const int me = ring.rank();
    auto call_start = std::chrono::steady_clock::now();
    const auto hook = [&](int it, stage s, micro_batch& mb, int& micro_batches) {
      call_start = std::chrono::steady_clock::now();
      ring.disarm();  // a shift fault stays within its call
      if (me != f.rank || it != f.iteration || s != f.where) return;
      switch (f.kind) {
        case fault::bad_token: mb.tokens[5] = config.vocab; break;
        case fault::bad_target: mb.targets[rows - 1] = -1; break;
        case fault::no_micro_batches: micro_batches = 0; break;
        case fault::shift_at_call: ring.arm(f.shift, false); break;
        case fault::shift_in_flight: ring.arm(f.shift, true); break;
      }
    };
    bool failed_here = false;
    std::string own, error;
    try {
      try {
        (void)train_rank(ring, iterations, adam_steps, hook);
      } catch (const config_error& e) {
        failed_here = true;
        own = e.what();
        ring.barrier();  // its report to the others; mismatches what they call next
      } catch (const communication_error& e) {
        if (!ring.fired()) throw;
        failed_here = true;
        own = e.what();
        ring.barrier();
      }
    } catch (const communication_error& e) {
      error = e.what();
    }
    const double seconds = seconds_since(call_start);
    if (f.everyone) {
      CHECK(failed_here);
      CHECK_MESSAGE(own.find(f.own_error) != std::string::npos, own);
      CHECK_MESSAGE(error.empty(), error);
      CHECK(seconds < 5.0);
      continue;
    }
    CHECK(failed_here == (me == f.rank));
    if (failed_here) CHECK_MESSAGE(own.find(f.own_error) != std::string::npos, own);
    CHECK_MESSAGE(error.find("collective mismatch") != std::string::npos, error);
    CHECK_MESSAGE(error.find("barrier") != std::string::npos, error);
    CHECK_MESSAGE(error.find(f.peer_call) != std::string::npos, error);
    CHECK(seconds < 5.0);  // from the start of the call that failed to the error
    if (me == 0) MESSAGE("fault on rank " << f.rank << ": rank 0 stopped " << seconds << " s into the call: " << error);
  }
}

}  // namespace rtp_gpt_test
