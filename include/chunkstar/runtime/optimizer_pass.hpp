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
#include <chunkstar/zero/shard_manager.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
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
};

/** @brief Calls `f(const step_chunk&)` for every gradient chunk of @p store that has a payload, in
 *  order, after its copy landed, without moving it (`grad`, `where`, `param_type`, `elems`,
 *  `tensors`, `slots` and `specs` set). A chunk on the disk is read into a host buffer for the
 *  call (`where` is then `host`): `f` only reads. */
template <class Store, class F>
void for_each_gradient(Store& store, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type,
                       F&& f) {
  struct aligned_free {
    void operator()(std::byte* p) const noexcept { ::operator delete (p, std::align_val_t{4096}); }
  };
  std::unique_ptr<std::byte, aligned_free> staging;
  for (std::uint32_t c = 0; c < plan.num_chunks; ++c) {
    const chunk_id id{chunk_kind::grad, c};
    if (!holds_payload(store.at(id).where)) continue;
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
                 std::size_t prefetch_depth)
      : store_(store), residency_(residency), tracer_(tracer), level_(level), stats_(stats), depth_(prefetch_depth) {}

  /** @brief True between a pass that threw and the run that completes it. */
  [[nodiscard]] bool in_progress() const noexcept { return next_ != 0; }
  /** @brief Forgets an unfinished pass: the next run starts from chunk index 0. */
  void abandon() noexcept { next_ = 0; }

  /** @brief An update: done when it returns, or still running on the returned stream. */
  using update_ref = function_ref<std::optional<typename Store::stream_type>(const step_chunk&)>;

  /** @brief Runs @p f once per chunk index not yet stepped in this pass (see the file comment),
   *  of the indices this rank owns under @p shards. */
  void run(update_ref f, const chunk_plan& plan, std::span<const tensor_spec> specs, dtype param_type,
           shard_map shards = {});

 private:
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
};

template <class Store, class Residency, class TracerT>
void optimizer_pass<Store, Residency, TracerT>::run(update_ref f, const chunk_plan& plan,
                                                    std::span<const tensor_spec> specs, dtype param_type,
                                                    shard_map shards) {
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
    const tier where = residency_.optimizer_tier(c);
    std::vector<chunk_id> ids;
    for (auto k : {chunk_kind::param, chunk_kind::grad, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance})
      if (store_.has(k)) ids.push_back({k, c});
    residency_.note_step(c, m, where);
    if (where == tier::device) {
      for (auto id : ids) {
        store_.touch(id);
        tracer_.record_access(id);
      }
      residency_.make_resident_on_device(ids, "optimizer", m);
    } else {
      // Streamed from the disk where they live there: reads for all of this chunk's lists start
      // before the first wait, and the host room they need never takes one of them.
      const std::unordered_set<chunk_id> keep(ids.begin(), ids.end());
      for (auto id : ids)
        if (store_.at(id).where == tier::disk) residency_.read_from_disk(id, keep, m, false);
      for (auto id : ids) residency_.make_resident_on_host(id, keep);
    }
    typename Store::pin_set pins(store_, ids);
    for (auto id : ids) store_.wait_user(store_.at(id));  // the update must see the user's last writes
    // The trace holds device accesses only, so it cannot know that a later chunk of this step
    // needs its lists on the host first: never fetch those up just to move them down again.
    residency_.prefetch(m,
                        [&](chunk_id id) { return id.index > c && residency_.optimizer_tier(id.index) == tier::host; });
    if (depth_) offload_ahead(c);
    const auto data = [&](chunk_kind k) { return store_.has(k) ? store_.at({k, c}).data : nullptr; };
    const step_chunk view{.index = c,
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
    next_ = c;  // until f returns, a retry starts here
    const auto stream = f(view);
    next_ = c + 1;
    if (stream) {  // the update still runs there: later moves wait for it
      const auto done = store_.copier().record(*stream);
      for (auto id : ids) store_.order_after_user(id, done);
      queued_ = true;
    }
    pins.reset();
    ++(where == tier::device ? stats_.device_steps : stats_.host_steps);
    // The gradient is spent: free it now rather than after the loop, so a host-side step never
    // needs every chunk's gradient on the host at once. A param stepped on the host goes back to
    // the compute tier while there is budget, which is where forward wants it (a load ahead).
    store_.release({chunk_kind::grad, c});
    if (where == tier::host && store_.device_in_use() + store_.bytes_of(chunk_kind::param) <= residency_.budget_now())
      optional([&] { residency_.load_ahead({chunk_kind::param, c}, /*touch=*/false); });
  }
  if (std::exchange(queued_, false)) wait_for_updates(plan.num_chunks);
  next_ = 0;
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
    if (residency_.optimizer_tier(next) != tier::host) continue;
    for (auto k :
         {chunk_kind::param, chunk_kind::grad, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance}) {
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
