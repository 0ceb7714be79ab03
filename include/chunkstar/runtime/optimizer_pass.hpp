// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The optimizer pass: one moment per chunk index, every list of that index made resident
 *         on the tier the placement chose, the user's update run on it, the gradient released
 *         right after, the next host-stepped chunks moved down while this one steps. Which lists a
 *         chunk index has comes from the runtime's `optimizer_state_lists` description.
 *
 *  Resumable: a pass that throws (no room, a copy engine or policy failure, or the update itself)
 *  keeps the chunks stepped so far, unpins everything, and the next `run` continues with the chunk
 *  that failed — so a retried step applies every chunk's update exactly once.
 *
 *  Early steps (`arm`): inside backward, a host-stepped chunk whose gradient is final steps before
 *  the pass (early_step_plan.hpp says which, after which moment); the pass then keeps that update
 *  (`early_outcome::keep`) or undoes and repeats it (`early_outcome::redo`).
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/function_ref.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/store/chunk_store.hpp>
#include <chunkstar/store/chunk_values.hpp>
#include <chunkstar/store/compute_level.hpp>
#include <chunkstar/observe/runtime_observer.hpp>
#include <chunkstar/runtime/early_step_plan.hpp>
#include <chunkstar/runtime/step_worker.hpp>
#include <chunkstar/zero/shard_manager.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <thread>
#include <span>
#include <unordered_set>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief One chunk index's data as handed to an optimizer step: every list's payload on `where`.
 *  Pointers are null for lists that do not exist (no master for fp32 params: the param is it;
 *  no variance for an optimizer with one moment). */
struct step_chunk {
  std::size_t index = 0;
  tier where = tier::host;
  dtype param_type = dtype::f32;
  std::size_t elems = 0;  ///< capacity of the chunk in elements (the same in every list)
  void* param = nullptr;
  void* grad = nullptr;
  float* master = nullptr;
  float* momentum = nullptr;
  float* variance = nullptr;
  std::span<const std::size_t> tensors;  ///< parameter indices in this chunk
  std::span<const tensor_slot> slots;    ///< slots of all parameters, indexed by parameter
  std::span<const tensor_spec> specs;    ///< specs of all parameters, indexed by parameter
  /// Host threads the update should use, where the runtime chose them (an early update on its
  /// worker: early_update_threads); 0: the update's own choice.
  int threads = 0;
};

/** @brief Calls `f(const step_chunk&)` for every gradient chunk of @p store that has a payload and
 *  that @p which accepts (`which(c)`, called once per chunk index with a payload), in order, after
 *  its copy landed, without moving it (`grad`, `where`, `param_type`, `elems`, `tensors`, `slots`
 *  and `specs` set). A chunk on the disk is read into a host buffer for the call (`where` is then
 *  `host`): `f` only reads. */
template <class Store, class F, class Which>
void for_each_gradient(Store& store, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type,
                       F&& f, Which&& which) {
  struct aligned_free {
    void operator()(std::byte* p) const noexcept { ::operator delete (p, std::align_val_t{4096}); }
  };
  std::unique_ptr<std::byte, aligned_free> staging;
  for (std::uint32_t c = 0; c < plan.num_chunks; ++c) {
    const chunk_id id{chunk_kind::grad, c};
    if (!holds_payload(store.at(id).where) || !which(c)) continue;
    store.wait(id);
    store.wait_user(store.at(id));  // the user's backward work on it (a scope closed on a stream)
    void* grad = store.at(id).data;
    tier where = store.at(id).where;
    if (where == tier::disk) {
      const std::size_t bytes = store.bytes_of(chunk_kind::grad);
      if (!staging) staging.reset(static_cast<std::byte*>(::operator new (bytes, std::align_val_t{4096})));
      chunk_values(store).read_bytes(id, 0, std::span<std::byte>(staging.get(), bytes));
      grad = staging.get();
      where = tier::host;
    }
    f(step_chunk{.index = c,
                 .where = where,
                 .param_type = param_type,
                 .elems = plan.chunk_elems,
                 .grad = grad,
                 .tensors = plan.chunk_tensors[c],
                 .slots = plan.slots,
                 .specs = specs});
  }
}

/** @brief What the pass does with the chunks stepped early: keep their update, or undo it and
 *  step them again with the others. */
enum class early_outcome { keep, redo };

/** @brief The speculative updates of one iteration (chunk_runtime::arm_early_steps): `update`
 *  steps a chunk on the host, `undo` puts back what it changed (empty: it cannot be undone), both
 *  called with the chunk's lists resident on the host; `kept_bytes_per_chunk` and `kept_budget` as
 *  in early_step_inputs. */
struct early_steps {
  std::function<void(const step_chunk&)> update;
  std::function<void(const step_chunk&)> undo;
  std::size_t kept_bytes_per_chunk = 0;
  std::size_t kept_budget = std::numeric_limits<std::size_t>::max();
  /// The update is its gradient's last reader (nothing can undo it, and what reads gradients after
  /// backward, a norm, read it first): the gradient is freed as soon as the update is joined
  /// rather than at the step, so the host does not hold every stepped chunk's gradient till then.
  bool spends_gradient = false;
};

/** @brief The step over every chunk index. @tparam Residency a residency_manager over the same store.
 *
 *  The update `f(step_chunk)` either finishes its work before it returns (returns void, or an
 *  empty optional), or hands it back still running on a stream (returns `std::optional<stream>`
 *  holding it, the platform's stream type): the chunk's later moves are then ordered after that
 *  work, its gradient is freed once the work is done, and the pass goes on to the next chunk at
 *  once — so a chunk stepped on the device overlaps the next chunks' host steps. The pass ends by
 *  waiting for every update it handed back. */
template <class Store, class Residency, class TracerT>
class optimizer_pass {
 public:
  optimizer_pass(Store& store, Residency& residency, TracerT& tracer, compute_level& level, runtime_stats& stats,
                 std::size_t prefetch_depth, bool background_updates = false)
      : store_(store),
        residency_(residency),
        tracer_(tracer),
        level_(level),
        stats_(stats),
        depth_(prefetch_depth),
        worker_(background_updates) {}

  /** @brief True between a pass that threw and the run that completes it. */
  [[nodiscard]] bool in_progress() const noexcept { return next_ != 0; }
  /** @brief Forgets an unfinished pass: the next run starts from chunk index 0. */
  void abandon() noexcept { next_ = 0; }

  /** @brief An update: done when it returns, or still running on the returned stream. */
  using update_ref = function_ref<std::optional<typename Store::stream_type>(const step_chunk&)>;

  /** @brief Runs @p f once per chunk index not yet stepped in this pass (see the file comment),
   *  of the indices this rank owns under @p shards; a chunk stepped early is kept or, with
   *  `early_outcome::redo`, undone and stepped by @p f again. Ends the early steps. */
  void run(update_ref f, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type,
           shard_map shards = {}, early_outcome early = early_outcome::keep);

  // --- early steps ---------------------------------------------------------------------------------
  /** @brief Arms early steps until the pass runs or disarm(); the plan is made from the trace at
   *  the first run_early(), of the chunks this rank owns under @p shards, @p together chunks used
   *  as one (early_step_inputs::together). */
  void arm(early_steps e, shard_map shards = {}, std::size_t together = 1) {
    early_ = std::move(e);
    shards_ = shards;
    together_ = together;
    planned_ = false;
    stepping_ = false;
    cursor_ = 0;
    due_.clear();
    due_count_ = 0;
    done_.clear();
  }
  /** @brief Forgets the early steps of this iteration (the chunks stepped stay stepped; updates
   *  still running go on, joined as below). */
  void disarm() noexcept {
    early_.reset();
    due_.clear();
    due_count_ = 0;
    done_.clear();
  }
  /** @brief Waits for every early update still running (they may outlast the step: an update kept
   *  as it is runs on while the next forward starts) and releases their chunks; rethrows the first
   *  failure not yet reported (see join_quietly). Reports each update's span to `on_early_update`. */
  void join_early() {
    start_carried_where([](std::uint32_t) { return true; });
    join_quietly();
    report_failure();
  }
  /** @brief As join_early(), for the updates of the chunk indices of @p ids only (a scope about to
   *  use them); one the step carried over starts now. */
  void join_early(std::span<const chunk_id> ids) {
    const auto among = [&](std::uint32_t c) {
      return std::any_of(ids.begin(), ids.end(), [&](chunk_id id) { return id.index == c; });
    };
    start_carried_where(among);
    join_where([&](const early_job& j) { return among(j.chunk); });
    report_failure();
  }
  /** @brief Joins the early updates that have finished (never waits): their chunks may move again;
   *  then starts those the step carried over, as far as the host has room for them; with @p
   *  ahead, the next one also without room while no update runs (its room made as the scope
   *  that reads its chunk would make it: Belady's victims, sent down while this scope computes). */
  void reap_early(bool ahead = false) {
    join_finished();
    report_failure();
    while (!carried_.empty() && (host_has_room_for(carried_.front()) || (ahead && jobs_.empty()))) {
      try {
        start_carried(carried_.front());
      } catch (const state_error&) {
        throw;
      } catch (const std::exception&) {  // an optimisation: the scope that needs it starts it (and reports)
        break;
      }
    }
  }
  /** @brief Chunk indices whose update the step carried over to the next forward (below a disk
   *  tier, no room for their lists at the step), in the order they start. */
  [[nodiscard]] std::span<const std::uint32_t> carried() const noexcept { return carried_; }
  /** @brief As join_early(), without throwing, from inside work that must not be cut short (making
   *  room, starting the next early step): an update that failed before it changed its chunk, while
   *  the pass has not run, leaves the chunk to the pass; any other failure is kept and rethrown by
   *  the next join_early() or reap_early(), at the runtime's next call, so none is lost. */
  void join_quietly() noexcept {
    join_where([](const early_job&) { return true; });
  }
  /** @brief True while early updates hold their chunks pinned (not joined yet). */
  [[nodiscard]] bool early_running() const noexcept { return !jobs_.empty(); }
  /** @brief Runs @p make_room (making chunks resident); where it runs out of memory while early
   *  updates hold chunks pinned (a host full below a disk tier), joins them and tries once more. */
  template <class F>
  void with_room(F&& make_room) {
    try {
      make_room();
    } catch (const out_of_memory_error&) {
      if (jobs_.empty()) throw;
      join_quietly();  // the running ones: those carried over would need room themselves
      report_failure();
      make_room();
    }
  }
  /** @brief Frees chunk index @p c's gradient now, or when its early update is joined. */
  void release_gradient(std::uint32_t c) {
    if (std::find(carried_.begin(), carried_.end(), c) != carried_.end()) return;  // its update frees it
    for (auto& j : jobs_)
      if (j.chunk == c) {
        j.release_gradient = true;
        return;
      }
    store_.release({chunk_kind::grad, c});
  }
  /** @brief Called on the calling thread, as early updates are joined, with when each ran on the
   *  worker (the runtime reports them to its observer as steps: a timeline shows them inside backward). */
  std::function<void(std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point)> on_early_update;
  /** @brief Called by run() once each chunk index this rank steps is stepped (or found stepped
   *  early), in index order; an update still running on a stream is ordered before the chunk's
   *  next move and its next wait_user (ZeRO sends it to the other ranks from here: shard_manager::stepped). */
  std::function<void(std::uint32_t)> on_stepped;
  [[nodiscard]] bool armed() const noexcept { return early_.has_value(); }
  /** @brief Whether the early updates of this iteration can be undone (`early_steps::undo`). */
  [[nodiscard]] bool can_undo_early() const noexcept { return early_ && early_->undo; }
  /** @brief No more early steps this iteration; those taken stay (and can still be undone). */
  void stop_early() noexcept {
    early_plan_.after.clear();
    due_.clear();
    due_count_ = 0;
    planned_ = true;
  }
  /** @brief Chunk indices stepped early so far, in order. */
  [[nodiscard]] std::span<const std::uint32_t> stepped_early() const noexcept { return done_; }
  [[nodiscard]] bool stepped_early(std::uint32_t c) const noexcept {
    return std::find(done_.begin(), done_.end(), c) != done_.end();
  }
  /** @brief Steps the chunks planned after the moments up to @p closed (closed scopes of the
   *  traced iteration) whose gradient is in place (@p in_place: under ZeRO, reduced to this rank;
   *  one that is not yet waits for a later call). Nothing when the trace is not ready; the plan is
   *  made on the first call. With @p last (the step, keeping the updates: no later call), the
   *  chunks still due start in the order the next forward needs them, and one whose lists do not
   *  fit the host below a disk tier is carried over (carried()): it starts as the next forward's
   *  scopes find room, at the latest when a scope, a read or a move needs its chunk (join_early),
   *  rather than the step waiting for the updates running to free its room (under ZeRO also
   *  before this rank sends the chunk: a gather waits for its update, `before_send`). */
  void run_early(std::size_t closed, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type,
                 function_ref<bool(std::uint32_t)> in_place, bool last = false);
  /** @brief Undoes chunk @p c's early step (a scope about to use it: the iteration left its trace).
   *  @throws state_error when the update cannot be undone. */
  void undo_early(std::uint32_t c, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type);
  /** @brief Undoes every early step (a skipped step, an abandoned iteration) and disarms.
   *  @throws state_error, changing nothing, when some were taken and nothing can undo them. */
  void undo_all_early(const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type);

 private:
  /** Brings chunk index @p c's lists to the host, pins them and queues @p update on the worker;
   *  @p release_gradient: its gradient goes at the join; @p by_step: queued by (or for) the step,
   *  it takes every thread; @p carried: the step carried it over (start_carried). @throws what
   *  moving the lists or starting the worker throws (nothing is then queued). */
  void start_update(std::uint32_t c, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type,
                    const std::function<void(const step_chunk&)>& update, bool release_gradient, bool by_step,
                    bool carried = false);
  /** Starts the update the step carried over for chunk index @p c (none: nothing), room made
   *  first from the updates running. On a throw it stays carried. */
  void start_carried(std::uint32_t c);
  /** start_carried() for each chunk index carried over now that @p which selects (once each: one
   *  whose start fails, put back by a join, waits for the next call). */
  template <class Which>
  void start_carried_where(Which which) {
    if (carried_.empty()) return;
    const std::vector<std::uint32_t> now = carried_;
    for (const std::uint32_t c : now)
      if (which(c)) start_carried(c);
  }
  /** When chunk index @p c's weights are read next, as a moment of this iteration's numbering (the
   *  next iteration's moments follow on): comparable between chunks made due at different moments. */
  [[nodiscard]] std::size_t next_use_of(std::uint32_t c) const {
    const std::size_t m = tracer_.current_moment(), in = tracer_.next_use({chunk_kind::param, c}, m);
    return in == never ? never : m + in;
  }
  /** Chunk index @p c's lists where they are now, as an update sees them on tier @p where. */
  step_chunk view_of(std::uint32_t c, tier where, const chunk_plan& plan, std::span<const tensor_spec> specs,
                     dtype param_type) const {
    const auto data = [&](chunk_kind k) { return store_.has(k) ? store_.at({k, c}).data : nullptr; };
    return {.index = c,
            .where = where,
            .param_type = param_type,
            .elems = plan.chunk_elems,
            .param = data(chunk_kind::param),
            .grad = data(chunk_kind::grad),
            .master = static_cast<float*>(data(chunk_kind::master)),
            .momentum = static_cast<float*>(data(chunk_kind::momentum)),
            .variance = static_cast<float*>(data(chunk_kind::variance)),
            .tensors = plan.chunk_tensors[c],
            .slots = plan.slots,
            .specs = specs};
  }
  /** Chunk index @p c's chunk of every list the store has. */
  [[nodiscard]] std::vector<chunk_id> lists_of(std::uint32_t c) const {
    std::vector<chunk_id> ids;
    for (auto k : all_chunk_kinds)
      if (store_.has(k)) ids.push_back({k, c});
    return ids;
  }
  /** With a disk tier: whether chunk @p c's lists not on the host yet fit its budget now. */
  [[nodiscard]] bool host_has_room_for(std::uint32_t c) const {
    if (!store_.has_disk()) return true;
    std::size_t bytes = 0;
    for (auto k : all_chunk_kinds)
      if (store_.has(k) && store_.at({k, c}).where != tier::host)
        bytes += store_.footprint(tier::host, store_.bytes_of(k));
    return store_.resident(tier::host) + bytes <= residency_.host_budget();
  }
  /** Calls @p g(view) with chunk @p c's lists resident on the host and pinned. */
  template <class G>
  void on_host(std::uint32_t c, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type, G&& g);

  /** A chunk stepped on the host: its weights go back to the compute tier while there is budget,
   *  which is where forward wants them (a load ahead). */
  void weights_back(std::uint32_t c) {
    const chunk_id param{chunk_kind::param, c};
    if (store_.at(param).where == tier::host && !store_.at(param).pinned &&
        store_.device_in_use() + store_.bytes_of(chunk_kind::param) <= residency_.budget_now())
      residency_.load_ahead(param, /*touch=*/false);
  }

  /** Runs an optimisation; what fails here is left to the demand path (internal errors propagate). */
  template <class G>
  static void optional(G&& g) {
    try {
      g();
    } catch (const state_error&) {
      throw;
    } catch (const std::exception&) {
    }
  }

  /** Waits (on the host) for the updates still running on the user's stream: the step ends with
   *  every chunk's new values in place, whatever reads them next and on which stream. */
  void wait_for_updates(std::size_t chunks);

  /** While chunk @p c steps, start moving the next host-stepped chunks' lists down, so their
   *  copies overlap this chunk's step instead of stalling the next one. */
  void offload_ahead(std::uint32_t c);

  Store& store_;
  Residency& residency_;
  TracerT& tracer_;
  compute_level& level_;
  runtime_stats& stats_;
  std::size_t depth_;
  std::size_t next_ = 0;  // the first chunk index this pass has not stepped
  bool queued_ = false;   // an update of this pass was handed back on a stream
  std::optional<early_steps> early_;
  early_step_plan early_plan_;
  bool planned_ = false;                   // early_plan_ made for this arming
  shard_map shards_;                       // the chunks this rank steps (ZeRO)
  std::size_t together_ = 1;               // chunks used as one (ZeRO's groups)
  std::size_t cursor_ = 0;                 // the first moment whose planned chunks are not yet due
  std::vector<std::uint32_t> due_;         // planned chunks whose moment has passed, not yet stepped
  std::atomic<std::size_t> due_count_{0};  // due_.size() as the worker reads it (due, not started yet)
  // The step's updates it carried over (no room at the step), started by the next calls with the
  // step's update and the plan they had.
  std::vector<std::uint32_t> carried_;
  struct carried_context {
    const chunk_plan* plan = nullptr;
    std::span<const tensor_spec> specs;
    dtype param_type = dtype::f32;
    std::function<void(const step_chunk&)> update;
  } carry_;
  std::atomic<bool> stepping_{false};  // the step has begun: the next forward waits for the updates
  // The worker's load: its updates' thread-nanoseconds since the last step (added by the worker,
  // each at the threads the runtime chose for it, whatever the update took), the last iteration's
  // load (read by it), when the last step began and how long this thread has waited for updates
  // since.
  std::atomic<std::int64_t> update_thread_ns_{0};
  std::atomic<early_load> load_{early_load::unknown};
  std::chrono::steady_clock::time_point last_step_{};
  std::chrono::steady_clock::duration waited_{};
  std::vector<std::uint32_t> done_;  // chunks stepped early, in order
  /** An early update handed to the worker: its chunk's lists stay pinned until it is joined. */
  struct early_job {
    std::uint32_t chunk;
    typename Store::pin_set pins;
    struct outcome {
      std::chrono::steady_clock::time_point begin, end;
      bool started = false;  // the update was called: it may have changed the chunk
    };
    std::shared_ptr<outcome> span;
    std::shared_future<void> done;
    bool release_gradient = false;  // the pass is done with the chunk: its gradient goes at the join
    std::size_t next_use = 0;       // the worker's priority: the job it runs first has the lowest
    bool carried = false;           // started after the step returned (carried over)
  };
  /** Joins the update the worker runs first of those not joined (running, or next); false if none.
   *  A failure is kept for the next join_early() or reap_early(), as join_quietly's. */
  bool join_next_early() noexcept {
    if (jobs_.empty()) return false;
    if (join_finished() > 0) return true;  // those done freed their room without waiting
    const auto first = std::min_element(jobs_.begin(), jobs_.end(),
                                        [](const early_job& a, const early_job& b) { return a.next_use < b.next_use; });
    const std::uint32_t c = first->chunk;
    join_where([&](const early_job& j) { return j.chunk == c; });
    return true;
  }
  /** Joins the updates that have finished (never waits); returns how many. Failures as join_where's. */
  std::size_t join_finished() noexcept {
    const std::size_t before = jobs_.size();
    join_where(
        [](const early_job& j) { return j.done.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
    return before - jobs_.size();
  }
  /** Joins the updates of the chunks @p which selects, in the order submitted; failures go to
   *  failure_ (see join_quietly). */
  template <class Which>
  void join_where(Which which) noexcept {
    std::ptrdiff_t put_back = 0;  // updates carried over that failed unchanged, put back in front
    for (std::size_t i = 0; i < jobs_.size();) {
      if (!which(jobs_[i])) {
        ++i;
        continue;
      }
      early_job j = std::move(jobs_[i]);
      jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(i));
      bool spent = true;  // the update ran (or failed part-way): its gradient is done with
      const auto t0 = std::chrono::steady_clock::now();
      j.done.wait();
      waited_ += std::chrono::steady_clock::now() - t0;
      const std::exception_ptr read_failed = settle_reads(j.chunk);
      try {
        if (read_failed) std::rethrow_exception(read_failed);  // the store's account of it, not the worker's
        j.done.get();
      } catch (...) {
        spent = j.span->started;
        const auto it = std::find(done_.begin(), done_.end(), j.chunk);
        if (!j.span->started && early_ && it != done_.end() && !j.carried) {
          done_.erase(it);  // unchanged: the pass steps it
        } else {
          // Unchanged: started again later, before those carried over that it started ahead of.
          if (!j.span->started && j.carried) carried_.insert(carried_.begin() + put_back++, j.chunk);
          if (!failure_) failure_ = std::current_exception();
        }
      }
      j.pins.reset();  // the chunk is the pass's again whatever the update did
      if (j.release_gradient && spent) store_.release({chunk_kind::grad, j.chunk});
      // As the pass's: left on the host, the stepped chunks' weights would crowd out the Adam state
      // (below a disk tier, off to the disk and back).
      try {
        weights_back(j.chunk);
      } catch (...) {  // an optimisation: the next forward loads it on demand
      }
      if (on_early_update) {
        try {
          on_early_update(j.span->begin, j.span->end);
        } catch (...) {  // an observer must not break memory management
        }
      }
    }
  }
  /** Settles the disk reads an update of chunk index @p c waited for (the store's outcome: a
   *  failed read leaves the chunk on the disk as before it, which the pass or a later start reads
   *  again); returns the first failure. */
  std::exception_ptr settle_reads(std::uint32_t c) noexcept {
    std::exception_ptr failed;
    for (auto k : all_chunk_kinds) {
      try {
        if (store_.has(k)) store_.resolve_disk({k, c});
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    return failed;
  }
  /** Rethrows (once) an early update's failure that join_where kept. */
  void report_failure() {
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  }
  std::exception_ptr failure_;  // an early update that failed, not yet rethrown
  std::vector<early_job> jobs_;
  step_worker worker_;  // after jobs_: joined before their pins are released
};

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::run(update_ref f, const chunk_plan& plan,
                                                    std::span<const tensor_spec> specs, dtype param_type,
                                                    shard_map shards, early_outcome early) {
  // Updates an earlier step carried over that nothing needed since come before this step's (this
  // step's own, in done_, start as the next forward finds room).
  start_carried_where([&](std::uint32_t c) { return !stepped_early(c); });
  if (early == early_outcome::redo) join_early();  // undone below: the updates must have finished
  if (!early_) last_step_ = {};  // an iteration without early steps: the next one's load is not measured
  for (std::uint32_t c = static_cast<std::uint32_t>(next_); c < plan.num_chunks; ++c) {
    if (!shards.owns(c)) continue;  // ZeRO: another rank steps it
    // One moment per chunk index, so the trace orders the step's chunks like any scope's: Belady
    // sees which state is needed next and the prefetcher loads the next chunks while this steps.
    const std::size_t m = tracer_.open_moment(moment_kind::optimizer, "optimizer");
    level_.changes = 0;
    level_.kind = moment_kind::optimizer;
    level_.releasing = c;
    struct end_moment {  // on any exit: this moment no longer frees a gradient
      compute_level& l;
      ~end_moment() { l.releasing = never; }
    } guard{level_};
    store_.retire_completed();
    if (early == early_outcome::keep && stepped_early(c)) {  // its update is in (or running): its gradient goes
      next_ = c + 1;
      release_gradient(c);
      if (on_stepped) on_stepped(c);
      continue;
    }
    const tier where = residency_.optimizer_tier(c);
    const std::vector<chunk_id> ids = lists_of(c);
    residency_.note_step(c, m, where);
    if (where == tier::device) {
      for (auto id : ids) {
        store_.touch(id);
        tracer_.record_access(id);
      }
      with_room([&] { residency_.make_resident_on_device(ids, "optimizer", m); });
    } else {
      // Streamed from the disk where they live there: reads for all of this chunk's lists start
      // before the first wait, and the host room they need never takes one of them.
      const std::unordered_set<chunk_id> keep(ids.begin(), ids.end());
      for (auto id : ids)
        if (store_.at(id).where == tier::disk) residency_.read_from_disk(id, keep, m, false);
      with_room([&] {
        for (auto id : ids) residency_.make_resident_on_host(id, keep);
      });
    }
    typename Store::pin_set pins(store_, ids);
    for (auto id : ids) store_.wait_user(store_.at(id));  // the update must see the user's last writes
    // The trace holds device accesses only, so it cannot know that a later chunk of this step
    // needs its lists on the host first: never fetch those up just to move them down again.
    residency_.prefetch(m,
                        [&](chunk_id id) { return id.index > c && residency_.optimizer_tier(id.index) == tier::host; });
    if (depth_) offload_ahead(c);
    const step_chunk view = view_of(c, where, plan, specs, param_type);
    next_ = c;  // until f returns, a retry starts here
    std::optional<typename Store::stream_type> stream;
    if (!stepped_early(c)) stream = f(view);
    else if (early == early_outcome::redo) {  // undone and stepped again, exactly once even on a retry
      early_->undo(view);
      done_.erase(std::find(done_.begin(), done_.end(), c));
      stream = f(view);
    }
    next_ = c + 1;
    if (stream) {  // the update still runs there: later moves wait for it
      const auto done = store_.copier().record(*stream);
      for (auto id : ids) store_.order_after_user(id, done);
      queued_ = true;
    }
    pins.reset();
    ++(where == tier::device ? stats_.device_steps : stats_.host_steps);
    // The gradient is spent: free it now rather than after the loop, so a host-side step never
    // needs every chunk's gradient on the host at once.
    store_.release({chunk_kind::grad, c});
    if (where == tier::host) optional([&] { weights_back(c); });
    if (on_stepped) on_stepped(c);
  }
  if (std::exchange(queued_, false)) wait_for_updates(plan.num_chunks);
  next_ = 0;
  disarm();
}

template <class Store, class Residency, class TracerT>
template <class G>
void optimizer_pass<Store, Residency, TracerT>::on_host(std::uint32_t c, const chunk_plan& plan,
                                                        std::span<const tensor_spec> specs, dtype param_type, G&& g) {
  const std::vector<chunk_id> ids = lists_of(c);
  const std::unordered_set<chunk_id> keep(ids.begin(), ids.end());
  for (auto id : ids) residency_.make_resident_on_host(id, keep);
  typename Store::pin_set pins(store_, ids);
  for (auto id : ids) store_.wait_user(store_.at(id));
  g(view_of(c, tier::host, plan, specs, param_type));
}

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::run_early(std::size_t closed, const chunk_plan& plan,
                                                          std::span<const tensor_spec> specs, dtype param_type,
                                                          function_ref<bool(std::uint32_t)> in_place, bool last) {
  if (!early_ || !tracer_.ready() || closed == never) return;
  if (last && !stepping_.exchange(true)) {  // the step: once an iteration, measure the worker's load
    const auto now = std::chrono::steady_clock::now();
    const double updates = static_cast<double>(update_thread_ns_.exchange(0)) * 1e-9;
    if (last_step_ != std::chrono::steady_clock::time_point{})
      load_ = early_load_of(updates, std::chrono::duration<double>(now - last_step_ - waited_).count(),
                            std::thread::hardware_concurrency());
    last_step_ = now;
    waited_ = {};
  }
  if (!planned_) {
    early_step_inputs in{.step_tier = {},
                         .kept_bytes_per_chunk = early_->kept_bytes_per_chunk,
                         .kept_budget = early_->kept_budget,
                         .together = together_};
    for (std::size_t c = 0; c < plan.num_chunks; ++c)  // another rank's chunk steps there
      in.step_tier.push_back(shards_.owns(c) ? residency_.optimizer_tier(c) : tier::remote);
    early_plan_ = plan_early_steps(sharding_trace_of(tracer_), in);
    planned_ = true;
  }
  for (; cursor_ <= closed && cursor_ < early_plan_.after.size(); ++cursor_)
    for (const std::uint32_t c : early_plan_.at(cursor_)) due_.push_back(c);
  // What the next forward reads first starts first (those left waiting are the ones it reads
  // last, and the last to start overlap it); inside backward, gradients the device has finished
  // before those it still computes (a copy of one of those would hold the lane).
  order_due_updates(
      due_, [&](std::uint32_t c) { return next_use_of(c); },
      [&](std::uint32_t c) {
        const auto& g = store_.at({chunk_kind::grad, c});
        try {
          return !g.user_done || g.user_done->ready();
        } catch (...) {  // a failed piece of the user's work: its copy reports it
          return false;
        }
      },
      last);
  for (std::size_t i = 0; i < due_.size();) {
    const std::uint32_t c = due_[i];
    if (stepped_early(c) || !holds_payload(store_.at({chunk_kind::grad, c}).where)) {
      due_.erase(due_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    // At the step, below a disk tier, no room: carried over to the next forward (it starts as room
    // frees, at the latest before a scope reads the chunk or this rank sends it), so the step
    // returns; never room from Adam state sent down that the next iteration's steps read back.
    if (last && !host_has_room_for(c)) join_finished();  // room from the updates done, without waiting
    if (last && !host_has_room_for(c) && in_place(c)) {
      due_.erase(due_.begin() + static_cast<std::ptrdiff_t>(i));
      carry_ = {&plan, specs, param_type, early_->update};
      carried_.push_back(c);
      done_.push_back(c);  // the pass keeps it as stepped; its gradient stays till the update is joined
      continue;
    }
    if (last)
      while (!host_has_room_for(c) && join_next_early()) {
      }
    // Not yet (a later scope's opening tries again; the pass, at the latest): its reduction still
    // runs, or, below a disk tier, its lists would not fit the host without sending state down
    // that is needed sooner (the early step would then cost the disk more than it hides).
    if (!in_place(c) || !host_has_room_for(c)) {
      ++i;
      continue;
    }
    due_.erase(due_.begin() + static_cast<std::ptrdiff_t>(i));
    due_count_ = due_.size();         // before the job: it reads what waits behind it
    done_.reserve(done_.size() + 1);  // the push below cannot throw once the update is queued
    start_update(c, plan, specs, param_type, early_->update, early_->spends_gradient, last);
    // Queued (not queued: the pass steps it). Joins run on this thread, so it is in done_ before
    // any of them sees the update, which may have changed the chunk: undo covers it.
    done_.push_back(c);
  }
  due_count_ = due_.size();
}

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::start_update(std::uint32_t c, const chunk_plan& plan,
                                                             std::span<const tensor_spec> specs, dtype param_type,
                                                             const std::function<void(const step_chunk&)>& update,
                                                             bool release_gradient, bool by_step, bool carried) {
  start_carried(c);  // the last step's update of it, carried over and never needed since: first
  join_where([&](const early_job& j) { return j.chunk == c; });  // the last iteration's (long done by now)
  // The lists come to the host, pinned while the worker runs the update; this thread goes on to
  // the next scope. Copies from the device are started, not waited for (the worker waits), and
  // so are reads from the disk for an update the step carried over: one whose read fails stays
  // carried over, unstarted, the failure reported (join_where); the store settles the read when
  // the update is joined (settle_reads). Inside backward a read ends here, on this thread (the
  // disk prefetcher's too): the pass may count the chunk as stepped before the update is joined,
  // and a failed read must leave it to the pass (measured no slower: docs/disk.md).
  const std::vector<chunk_id> ids = lists_of(c);
  const std::unordered_set<chunk_id> keep(ids.begin(), ids.end());
  for (auto id : ids) {
    const tier where = store_.at(id).where;
    if (where == tier::device) residency_.offload(id, keep);
    else if (where == tier::disk && carried) residency_.read_from_disk(id, keep, tracer_.current_moment(), false);
    else if (where != tier::host) residency_.make_resident_on_host(id, keep);
    if (!carried) store_.resolve_disk(id);
  }
  typename Store::pin_set pins(store_, ids);
  struct inputs {  // what the update waits for: shared by the job and the worker's look at it (ready)
    std::vector<typename Store::copy_handle> arrivals;
    std::vector<disk_copy_handle> reads;
  };
  auto in = std::make_shared<inputs>();
  for (auto id : ids) {
    const auto& s = store_.at(id);
    if (s.pending) in->arrivals.push_back(*s.pending);
    if (s.user_done) in->arrivals.push_back(*s.user_done);
    if (s.disk_pending) in->reads.push_back(s.disk_pending->done);  // a read filling the host buffer
  }
  const step_chunk view = view_of(c, tier::host, plan, specs, param_type);
  auto span = std::make_shared<typename early_job::outcome>();
  auto finished = std::make_shared<std::promise<void>>();
  // Of the updates waiting, the one whose weights the next iteration reads first runs first.
  const std::size_t priority = next_use_of(c);
  jobs_.push_back({c, std::move(pins), span, finished->get_future().share(), release_gradient, priority, carried});
  // Queued by the step, it is due for the next forward even when it starts after the next arm().
  auto job = [this, in, view, update, span, finished, by_step]() mutable {
    try {
      for (auto& h : in->reads) h.wait();  // a failed read throws here: the chunk is unchanged
      for (auto& h : in->arrivals) h.wait();
      span->begin = std::chrono::steady_clock::now();
      span->started = true;
      step_chunk with_threads = view;  // as many threads as the worker's load and backlog call for
      with_threads.threads = early_update_threads(
          std::thread::hardware_concurrency(), worker_.in_flight() - 1, due_count_.load(std::memory_order_relaxed),
          by_step || stepping_.load(std::memory_order_relaxed), load_.load(std::memory_order_relaxed));
      update(with_threads);
      span->end = std::chrono::steady_clock::now();
      update_thread_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(span->end - span->begin).count() *
                           std::max(with_threads.threads, 1);
      finished->set_value();
    } catch (...) {
      finished->set_exception(std::current_exception());
    }
  };
  // Ready once its lists are on the host: inside backward the worker starts such an update before
  // one whose lists are still coming down (step_worker's next_job), rather than idle meanwhile.
  auto ready = [in] {
    return std::all_of(in->reads.begin(), in->reads.end(), [](const auto& h) { return h.ready(); }) &&
           std::all_of(in->arrivals.begin(), in->arrivals.end(), [](const auto& h) { return h.ready(); });
  };
  try {
    worker_.submit(std::move(job), priority, std::move(ready));
  } catch (...) {  // not queued (no thread): nothing runs it, nothing may wait for it
    jobs_.pop_back();
    throw;
  }
  ++stats_.host_steps;
  ++stats_.early_steps;
}

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::start_carried(std::uint32_t c) {
  if (std::find(carried_.begin(), carried_.end(), c) == carried_.end()) return;
  // Room from the updates running first, as at the step; then, if there is still none, from the
  // host's other chunks (a scope needs this one now).
  while (!host_has_room_for(c) && join_next_early()) {
  }
  const auto it = std::find(carried_.begin(), carried_.end(), c);
  if (it == carried_.end()) return;
  carried_.erase(it);
  try {
    start_update(c, *carry_.plan, carry_.specs, carry_.param_type, carry_.update, true, true, /*carried=*/true);
  } catch (...) {  // not started: still carried, the next call tries again
    carried_.insert(carried_.begin(), c);
    throw;
  }
}

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::undo_early(std::uint32_t c, const chunk_plan& plan,
                                                           std::span<const tensor_spec> specs, dtype param_type) {
  if (!stepped_early(c)) return;
  join_early();
  if (!early_->undo)
    throw state_error("chunk " + std::to_string(c) +
                      " was stepped early (inside backward, the trace saying its gradient was final) but a later "
                      "scope uses it: this iteration left the traced one. Call the optimizer's prepare() only "
                      "before iterations that repeat the traced one, or keep what undoes a step (clipping or a "
                      "dynamic loss scale keep it)");
  on_host(c, plan, specs, param_type, [&](const step_chunk& view) { early_->undo(view); });
  done_.erase(std::find(done_.begin(), done_.end(), c));
}

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::undo_all_early(const chunk_plan& plan,
                                                               std::span<const tensor_spec> specs, dtype param_type) {
  if (!done_.empty() && !can_undo_early())
    throw state_error(std::to_string(done_.size()) +
                      " chunk(s) stepped early in this iteration cannot be undone: nothing kept what undoes them "
                      "(without clipping and with a static loss scale the optimizer's prepare() keeps nothing, "
                      "and the update is final). Finish the iteration with step(), or load the last checkpoint; "
                      "to be able to abandon an iteration after prepare(), clip (max_grad_norm > 0)");
  while (!done_.empty()) undo_early(done_.back(), plan, specs, param_type);
  disarm();
}

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::wait_for_updates(std::size_t chunks) {
  for (std::uint32_t c = 0; c < chunks; ++c)
    for (auto k : {chunk_kind::param, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance})
      if (store_.has(k)) store_.wait_user(store_.at({k, c}));
}

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::offload_ahead(std::uint32_t c) {
  for (std::uint32_t next = c + 1, n = 0; next < store_.num_chunks() && n < depth_; ++next, ++n) {
    // Stepped early (or carried over): nothing of it comes down for this pass.
    if (residency_.optimizer_tier(next) != tier::host || stepped_early(next)) continue;
    for (auto k : all_chunk_kinds) {
      if (!store_.has(k)) continue;
      const chunk_id id{k, next};
      auto& s = store_.at(id);
      if (s.where != tier::device || s.pinned) continue;
      optional([&] {
        residency_.offload(id, {{chunk_kind::param, next},
                                {chunk_kind::grad, next},
                                {chunk_kind::master, next},
                                {chunk_kind::momentum, next},
                                {chunk_kind::variance, next}});
      });
    }
  }
}

}  // namespace chunkstar
