// SPDX-License-Identifier: Apache-2.0
// A CopyEngine test double that steps by hand (docs style entry 19, after stdexec's
// impulse_scheduler): nothing it is asked to do happens until the test says so, so ordering and
// overlap bugs are reproduced deterministically instead of by timing.
//
//  * Every call is recorded, in order, as a `scripted_op` (copy, copy_async, zero_async,
//    order_after with the id of the handle it orders after, record with the stream, synchronize),
//    including calls that an injected fault made throw.
//  * Jobs queue per lane, like CUDA streams: `to_device`, `to_host`, and `host_to_host` (where
//    zero_async goes). A job runs — the bytes are really copied or zeroed, so tests check data —
//    only when the test releases it: `release_next(lane)`, `fail_next(lane)`, `release_all()`.
//    `order_after(h, lane)` with an unfinished `h` queues a barrier on that lane: the lane's later
//    jobs cannot be released until `h` finishes (`blocked(lane)` says so).
//  * `record(scripted_stream)` returns a handle for "the user's work on that stream so far"; it
//    is in no lane and finishes only when the test calls `complete(handle)` or
//    `complete_stream(stream)` (the stream contract, by hand).
//  * Waiting on an unfinished handle never deadlocks the single test thread. `wait()` then
//    finishes the job itself — releasing what is queued ahead of it in its lane, and, through
//    barriers, what those wait for (a user handle completes) — and records a *stall*: the id of
//    the handle the runtime waited for is appended to `stalls()` and `on_stall` (if set) is called
//    with it. A test that requires the runtime never to wait sets `on_stall` to a doctest
//    FAIL_CHECK (strict mode: the failure is reported and the test still runs to the end, with no
//    undefined behaviour). Synchronous calls (`copy`, `synchronize`) finish what they need without
//    counting a stall: blocking is their documented contract.
//  * Faults: `throw_on(kind, nth)` makes the nth next call of that kind throw `scripted_fault`
//    before queueing anything.
//
// Single-threaded by design: the test's thread drives both the runtime and the releases (the
// engine takes no locks; do not use it from several threads). The destructor runs every job still
// queued (completing user handles), as a real engine finishes its queues, and detaches the handles.
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>
#include <chunkstar/memory/platform.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar::testing {

/** The stream of the scripted platform: where the test pretends user work runs. Copyable. */
struct scripted_stream {
  int id = 0;
  friend constexpr bool operator==(scripted_stream, scripted_stream) noexcept = default;
};

/** What the engine was asked to do. */
enum class scripted_op_kind : std::uint8_t { copy, copy_async, zero_async, order_after, record, synchronize };

inline const char* to_string(scripted_op_kind k) noexcept {
  switch (k) {
    case scripted_op_kind::copy: return "copy";
    case scripted_op_kind::copy_async: return "copy_async";
    case scripted_op_kind::zero_async: return "zero_async";
    case scripted_op_kind::order_after: return "order_after";
    case scripted_op_kind::record: return "record";
    case scripted_op_kind::synchronize: return "synchronize";
  }
  return "?";
}

/** One recorded call. `handle`: the id of the handle the call returned (copy, copy_async,
 *  zero_async, record), or for order_after the id of the handle it orders after (0: an empty,
 *  already ready handle). */
struct scripted_op {
  scripted_op_kind kind = scripted_op_kind::copy_async;
  copy_direction lane = copy_direction::host_to_host;  ///< copies: their direction; zero_async: host_to_host
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  std::uint64_t handle = 0;
  int stream = -1;     ///< record: the stream's id
  bool threw = false;  ///< an injected fault made this call throw; nothing was queued
};

/** The exception `throw_on` injects. */
struct scripted_fault : chunkstar::error {
  explicit scripted_fault(const std::string& what) : chunkstar::error("scripted fault: " + what) {}
};

class scripted_copy_engine;

namespace detail {
enum class scripted_job_kind : std::uint8_t { copy, zero, user };
struct scripted_job {
  std::uint64_t id = 0;
  scripted_job_kind kind = scripted_job_kind::copy;
  copy_direction lane = copy_direction::host_to_host;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  int stream = -1;
  bool done = false;
  std::exception_ptr error;                // set when the test failed the job
  scripted_copy_engine* engine = nullptr;  // null once the engine is gone (the job is then done)
};
}  // namespace detail

/** Completion of one scripted job. Models `CopyHandle`. */
class scripted_copy_handle {
 public:
  scripted_copy_handle() = default;
  explicit scripted_copy_handle(std::shared_ptr<detail::scripted_job> j) noexcept : job_(std::move(j)) {}

  /** True once the test released (or failed) the job; an empty handle is ready. Never acts. */
  [[nodiscard]] bool ready() const noexcept { return !job_ || job_->done; }
  /** Returns at once when finished (rethrowing a failed job's error); otherwise finishes the job
   *  and records a stall (see the file comment). */
  inline void wait() const;
  /** The job's id as recorded in `scripted_op::handle` (0: empty handle). */
  [[nodiscard]] std::uint64_t id() const noexcept { return job_ ? job_->id : 0; }

 private:
  friend class scripted_copy_engine;
  std::shared_ptr<detail::scripted_job> job_;
};

/** The scripted engine. Models `CopyEngine`; `record(scripted_stream)` makes it a `Platform`'s engine. */
class scripted_copy_engine {
 public:
  scripted_copy_engine() = default;
  scripted_copy_engine(const scripted_copy_engine&) = delete;
  scripted_copy_engine& operator=(const scripted_copy_engine&) = delete;
  ~scripted_copy_engine() {
    try {
      drain(/*complete_users=*/true);
    } catch (...) {  // a destructor never throws
    }
    for (auto& j : jobs_) {
      j->done = true;
      j->engine = nullptr;
    }
  }

  // --- CopyEngine ----------------------------------------------------------------------------
  /** Synchronous: queues the copy and finishes it (with what is queued ahead of it); not a stall. */
  void copy(void* dst, const void* src, std::size_t bytes, copy_direction d) {
    auto h = queue(scripted_op_kind::copy, detail::scripted_job_kind::copy, d, dst, src, bytes);
    finish(*h.job_, /*stall=*/false);
  }
  scripted_copy_handle copy_async(void* dst, const void* src, std::size_t bytes, copy_direction d) {
    return queue(scripted_op_kind::copy_async, detail::scripted_job_kind::copy, d, dst, src, bytes);
  }
  scripted_copy_handle zero_async(void* dst, std::size_t bytes) {
    return queue(scripted_op_kind::zero_async, detail::scripted_job_kind::zero, copy_direction::host_to_host, dst,
                 nullptr, bytes);
  }
  /** Later jobs on @p d wait for @p h (a barrier on the lane) when @p h is unfinished. */
  void order_after(const scripted_copy_handle& h, copy_direction d) {
    scripted_op op{.kind = scripted_op_kind::order_after, .lane = d, .handle = h.id()};
    inject(op);
    ops_.push_back(op);
    if (!h.ready()) lanes_[index(d)].push_back(entry{nullptr, h.job_});
  }
  /** A handle for the user's work queued on @p s so far: finished by `complete` / `complete_stream`. */
  scripted_copy_handle record(const scripted_stream& s) {
    scripted_op op{.kind = scripted_op_kind::record, .stream = s.id};
    inject(op);
    auto j = make_job(detail::scripted_job_kind::user, copy_direction::host_to_host, nullptr, nullptr, 0);
    j->stream = s.id;
    op.handle = j->id;
    ops_.push_back(op);
    return scripted_copy_handle(std::move(j));
  }
  /** Finishes everything queued (and the user work barriers wait for); not a stall. */
  void synchronize() {
    ops_.push_back({.kind = scripted_op_kind::synchronize});
    drain(/*complete_users=*/true);
  }
  [[nodiscard]] copy_stats stats() const { return stats_; }

  // --- the test's hand ------------------------------------------------------------------------
  /** Runs the next job queued on @p d (its bytes are copied or zeroed now). False when the lane
   *  is empty or its head is a barrier on an unfinished handle. */
  bool release_next(copy_direction d) { return step(d, nullptr); }
  /** As release_next, but the job fails with @p why (its handle's wait() rethrows; nothing copied). */
  bool fail_next(copy_direction d, const std::string& why = "injected copy failure") {
    return step(d, std::make_exception_ptr(chunkstar::error("scripted copy failure: " + why)));
  }
  /** Releases jobs on every lane until none can run; user handles stay as they are. Returns how many ran. */
  std::size_t release_all() {
    std::size_t n = 0;
    for (bool progress = true; progress;) {
      progress = false;
      for (std::size_t i = 0; i < copy_direction_count; ++i)
        while (step(static_cast<copy_direction>(i), nullptr)) {
          ++n;
          progress = true;
        }
    }
    return n;
  }
  /** Completes the user work @p h stands for (a handle from record()). */
  void complete(const scripted_copy_handle& h) {
    if (!h.job_) return;
    if (h.job_->kind != detail::scripted_job_kind::user)
      throw std::logic_error("scripted_copy_engine::complete: handle " + std::to_string(h.id()) +
                             " is a queued job; release its lane");
    h.job_->done = true;
  }
  /** Completes every handle recorded on @p s so far. */
  void complete_stream(const scripted_stream& s) {
    for (auto& j : jobs_)
      if (j->kind == detail::scripted_job_kind::user && j->stream == s.id) j->done = true;
  }
  /** True when @p d's next job waits behind a barrier on an unfinished handle. */
  [[nodiscard]] bool blocked(copy_direction d) {
    auto& l = lanes_[index(d)];
    pop_satisfied(l);
    return !l.empty() && l.front().barrier != nullptr;
  }
  /** Jobs (not barriers) queued on @p d. */
  [[nodiscard]] std::size_t queued(copy_direction d) const {
    std::size_t n = 0;
    for (const auto& e : lanes_[index(d)]) n += e.job != nullptr;
    return n;
  }
  /** Jobs queued on every lane. */
  [[nodiscard]] std::size_t queued() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < copy_direction_count; ++i) n += queued(static_cast<copy_direction>(i));
    return n;
  }
  /** Every call so far, in order. */
  [[nodiscard]] const std::vector<scripted_op>& ops() const noexcept { return ops_; }
  void clear_ops() noexcept { ops_.clear(); }
  /** The ops of @p kind so far. */
  [[nodiscard]] std::vector<scripted_op> ops_of(scripted_op_kind kind) const {
    std::vector<scripted_op> v;
    for (const auto& o : ops_)
      if (o.kind == kind) v.push_back(o);
    return v;
  }
  /** Ids of the handles waited on before they were finished, in order. */
  [[nodiscard]] const std::vector<std::uint64_t>& stalls() const noexcept { return stalls_; }
  /** Called with the handle id at every stall (e.g. a FAIL_CHECK: strict mode). */
  std::function<void(std::uint64_t)> on_stall;
  /** The @p nth next call of @p kind (1: the very next) throws scripted_fault before doing anything. */
  void throw_on(scripted_op_kind kind, std::size_t nth = 1) { faults_[static_cast<std::size_t>(kind)] = nth; }
  /** The user handles recorded on @p s, oldest first. */
  [[nodiscard]] std::vector<scripted_copy_handle> user_handles(const scripted_stream& s) const {
    std::vector<scripted_copy_handle> v;
    for (const auto& j : jobs_)
      if (j->kind == detail::scripted_job_kind::user && j->stream == s.id) v.emplace_back(j);
    return v;
  }

 private:
  friend class scripted_copy_handle;
  struct entry {
    std::shared_ptr<detail::scripted_job> job;      // a job to run, or
    std::shared_ptr<detail::scripted_job> barrier;  // a handle the lane waits for
  };

  static std::size_t index(copy_direction d) {
    const auto i = static_cast<std::size_t>(d);
    if (i >= copy_direction_count) throw config_error("scripted_copy_engine: unknown copy_direction");
    return i;
  }

  void inject(scripted_op& op) {
    auto& n = faults_[static_cast<std::size_t>(op.kind)];
    if (n == 0 || --n != 0) return;
    op.threw = true;
    ops_.push_back(op);
    throw scripted_fault(std::string(to_string(op.kind)) + " #" + std::to_string(ops_.size()));
  }

  std::shared_ptr<detail::scripted_job> make_job(detail::scripted_job_kind k, copy_direction d, void* dst,
                                                 const void* src, std::size_t bytes) {
    auto j = std::make_shared<detail::scripted_job>();
    j->id = ++next_id_;
    j->kind = k;
    j->lane = d;
    j->dst = dst;
    j->src = src;
    j->bytes = bytes;
    j->engine = this;
    jobs_.push_back(j);
    return j;
  }

  scripted_copy_handle queue(scripted_op_kind op_kind, detail::scripted_job_kind k, copy_direction d, void* dst,
                             const void* src, std::size_t bytes) {
    scripted_op op{.kind = op_kind, .lane = d, .dst = dst, .src = src, .bytes = bytes};
    inject(op);
    auto& lane = lanes_[index(d)];
    auto j = make_job(k, d, dst, src, bytes);
    op.handle = j->id;
    ops_.push_back(op);
    lane.push_back(entry{j, nullptr});
    return scripted_copy_handle(std::move(j));
  }

  static void pop_satisfied(std::deque<entry>& l) {
    while (!l.empty() && l.front().barrier != nullptr && l.front().barrier->done) l.pop_front();
  }

  /** Runs (or fails) the head job of @p d; false when none can run. */
  bool step(copy_direction d, std::exception_ptr failure) {
    auto& l = lanes_[index(d)];
    pop_satisfied(l);
    if (l.empty() || l.front().barrier != nullptr) return false;
    auto j = l.front().job;
    l.pop_front();
    run(*j, std::move(failure));
    pop_satisfied(l);
    return true;
  }

  void run(detail::scripted_job& j, std::exception_ptr failure) {
    if (failure) {
      j.error = std::move(failure);
    } else if (j.bytes != 0) {
      if (j.kind == detail::scripted_job_kind::copy) std::memcpy(j.dst, j.src, j.bytes);
      else std::memset(j.dst, 0, j.bytes);
      if (j.kind == detail::scripted_job_kind::copy) {
        stats_[j.lane].bytes += j.bytes;
        stats_[j.lane].copies += 1;
      }
    } else if (j.kind == detail::scripted_job_kind::copy) {
      stats_[j.lane].copies += 1;
    }
    j.done = true;
  }

  /** Finishes @p j: what is ahead of it in its lane first, and through barriers what they wait for. */
  void finish(detail::scripted_job& j, bool stall) {
    if (j.done) return;
    if (stall) {
      stalls_.push_back(j.id);
      if (on_stall) on_stall(j.id);
    }
    if (j.kind == detail::scripted_job_kind::user) {
      j.done = true;
      return;
    }
    auto& l = lanes_[index(j.lane)];
    while (!j.done) {
      pop_satisfied(l);
      if (l.empty()) throw std::logic_error("scripted_copy_engine: job " + std::to_string(j.id) + " is in no lane");
      if (l.front().barrier != nullptr) {
        finish(*l.front().barrier, /*stall=*/false);
        continue;
      }
      auto head = l.front().job;
      l.pop_front();
      run(*head, nullptr);
    }
  }

  void drain(bool complete_users) {
    for (bool progress = true; progress;) {
      progress = release_all() > 0;
      for (std::size_t i = 0; i < copy_direction_count; ++i) {
        auto& l = lanes_[i];
        pop_satisfied(l);
        if (!l.empty() && l.front().barrier != nullptr && complete_users) {
          finish(*l.front().barrier, /*stall=*/false);
          progress = true;
        }
      }
    }
  }

  std::array<std::deque<entry>, copy_direction_count> lanes_;
  std::vector<std::shared_ptr<detail::scripted_job>> jobs_;  // every job, for complete_stream and the destructor
  std::vector<scripted_op> ops_;
  std::vector<std::uint64_t> stalls_;
  std::array<std::size_t, 6> faults_{};
  copy_stats stats_;
  std::uint64_t next_id_ = 0;
};

inline void scripted_copy_handle::wait() const {
  if (!job_) return;
  if (!job_->done && job_->engine != nullptr) job_->engine->finish(*job_, /*stall=*/true);
  if (job_->error) std::rethrow_exception(job_->error);
}

static_assert(CopyHandle<scripted_copy_handle>);
static_assert(CopyEngine<scripted_copy_engine>);

/** The CPU platform with the scripted engine: a simulated device (host-accessible), the host, and
 *  user work on `scripted_stream`s whose completion the test decides. */
using scripted_platform = platform<simulated_device_space, host_space, scripted_copy_engine, scripted_stream>;
static_assert(Platform<scripted_platform>);

}  // namespace chunkstar::testing
