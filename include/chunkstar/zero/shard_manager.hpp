// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief ZeRO sharding of the chunks over the ranks of a communicator (PatrickStar's "symbiosis
 *         with ZeRO"): consecutive chunks of each list form groups of N; chunk k is owned by rank
 *         k mod N, the only rank that keeps its payload (parameters, gradients, fp32 master, Adam
 *         moments). A scope that needs another rank's parameter chunk allgathers its group into a
 *         compute-tier group buffer; gradients of a group are accumulated in a group buffer and
 *         reduce-scattered to their owners once final; the optimizer steps owned chunks only.
 *
 *  Decisions (`shard_map`, `gradient_final`, `release_gathered`, `plan_gathers`) are pure
 *  functions of the ownership and the trace; `shard_manager` carries them out with the chunk store
 *  and the communicator. Every rank runs the same scopes, so every rank issues the same collectives in the
 *  same order (decisions read only logical state and the trace, never timing).
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/store/chunk_values.hpp>
#include <chunkstar/zero/gather_plan.hpp>
#include <chunkstar/zero/group_buffers.hpp>
#include <chunkstar/store/compute_level.hpp>
#include <chunkstar/zero/sharding_options.hpp>
#include <chunkstar/observe/runtime_stats.hpp>
#include <chunkstar/zero/shard_map.hpp>
#include <chunkstar/tracer/tracer.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <string>
#include <vector>

namespace chunkstar {

/** @brief True when gradient chunk @p id gets no more contributions in this iteration after moment
 *  @p m: its next use, per the trace, is the optimizer step or the next iteration. Without a trace:
 *  false (everything is reduced before the step). */
template <Tracer T>
[[nodiscard]] bool gradient_final(const T& tracer, chunk_id id, std::size_t m) {
  if (!tracer.ready()) return false;
  const std::size_t d = tracer.next_use(id, m), n = tracer.num_moments();
  return d == never || m + d >= n || tracer.kind_of(m + d) == moment_kind::optimizer;
}

/** @brief Without a trace (the first iteration, while it is recorded): gradient chunk c counts as
 *  final once backward scopes have used it as often as forward scopes used its parameters so far
 *  in this iteration (and at least once). Exact whenever backward mirrors forward, as autograd's
 *  does (a tied weight used by two forward scopes is final after its second backward use); if a
 *  later backward scope still adds to it, the owner adds that second reduction into its chunk: the
 *  same gradient in a different summation order, never a lost contribution. With gradient
 *  accumulation (sharding_options::micro_batches M > 1; a forward after a backward begins the next
 *  micro-batch) nothing is final before the M-th micro-batch, and there a chunk is final once
 *  backward has used it M times as often as in the first micro-batch (shard_manager::all_final). */
[[nodiscard]] constexpr bool gradient_final_untraced(std::uint32_t forward_uses, std::uint32_t backward_uses) noexcept {
  return backward_uses > 0 && backward_uses >= forward_uses;
}

/** @brief True when the gathered group of parameter chunks @p members should be released after
 *  moment @p m: its next use by a scope is not the very next moment (the next layer of the same
 *  group), or is in the next iteration; with @p keep, only in the next iteration. A use by the
 *  optimizer step does not count (only the owner steps, so counting it would make the ranks
 *  disagree). Without a trace: released at once (unless kept: then at the step). The same answer
 *  on every rank, since every rank records the same scopes. */
template <Tracer T>
[[nodiscard]] bool release_gathered(const T& tracer, std::span<const chunk_id> members, std::size_t m, bool keep) {
  if (!tracer.ready()) return !keep;
  std::size_t d = never;
  for (auto id : members) d = std::min(d, tracer.next_use(id, m));
  if (d == never || m + d >= tracer.num_moments() || tracer.kind_of(m + d) == moment_kind::optimizer) return true;
  return !keep && d > 1;
}

/** @brief Carries out the sharding: gathers, releases and reductions on the chunk store over the
 *  communicator. @tparam Residency makes room on the compute tier and the owned chunks resident. */
template <class Store, class Residency, Tracer TracerT, Communicator Comm>
class shard_manager {
 public:
  shard_manager(Store& store, Residency& residency, const TracerT& tracer, Comm& comm, sharding_options options,
                runtime_stats& stats, compute_level& level)
      : store_(store),
        buffers_(store),
        residency_(residency),
        tracer_(tracer),
        comm_(comm),
        options_(options),
        stats_(stats),
        level_(level) {
    level.sharded = active();  // gradients then come from group buffers, never zero-filled chunk by chunk
  }

  shard_manager(const shard_manager&) = delete;
  shard_manager& operator=(const shard_manager&) = delete;
  /** Waits for collectives still in flight (they write into this rank's buffers), then frees them. */
  ~shard_manager() { drop(); }

  [[nodiscard]] bool active() const noexcept { return options_.enabled && comm_.size() > 1; }
  [[nodiscard]] shard_map map() const noexcept {
    return active() ? shard_map{comm_.size(), comm_.rank()} : shard_map{};
  }
  [[nodiscard]] const sharding_options& options() const noexcept { return options_; }

  /** @brief Before a scope of @p kind over chunks @p ids opens (moment @p m): gathers the groups of
   *  its parameter chunks (in the memory-saving mode, each chunk from its owner), and in backward
   *  gives their gradients a group buffer (a one-chunk buffer). @return the chunks the demand path
   *  must still make resident (the owned ones). */
  std::vector<chunk_id> prepare(std::span<const chunk_id> ids, moment_kind kind, std::string_view who, std::size_t m);

  /** @brief Once the scope of moment @p m is open (its chunks pinned): starts the allgathers of
   *  the groups moment m + 1 needs, where the plan accepted them (see gather_plan.hpp), so they
   *  run while m computes; prepare(m + 1) waits for them. The plan is made when a trace is
   *  adopted and agreed across ranks then (one allreduce), so every rank starts the same gathers. */
  void gather_ahead(std::size_t m, std::string_view who);
  /** @brief The plan of gathers ahead for the current trace (empty before one is made). */
  [[nodiscard]] const gather_plan& plan() const noexcept { return plan_; }

  /** @brief A scope closed at moment @p m: its work (collectives, which may throw) is left for the
   *  next call into the runtime, `settle()`, since a scope closes in a destructor. */
  void closed(std::size_t m) noexcept;
  /** @brief Runs the work of the last scope closed (see after_close). */
  void settle();
  /** @brief close_backward(), then every reduction completed: only owned chunks left. */
  void finish_backward();
  /** @brief Before the optimizer step, without waiting: settle(), then every gradient group still
   *  open starts its reduction (in group order) and every gathered group is released; the last
   *  reductions may still be in flight. finish_one_reduction() completes them, oldest first, so
   *  that what reads each owned gradient (the norm's scan) can read those already final while the
   *  rest travel. */
  void close_backward();
  /** @brief Completes the oldest reduction in flight (see finish_reductions); false when none was. */
  bool finish_one_reduction();

  /** @brief After a scope closes at moment @p m: releases the gathered groups the trace says are
   *  done with, and reduce-scatters the gradient groups that are final. */
  void after_close(std::size_t m, bool untraced = false);

  /** @brief Drops what an abandoned iteration left: gradient groups (unreduced) and gathered
   *  groups; with @p keep_next, not the groups the step gathered for the next iteration. */
  void drop(bool keep_next = false) noexcept;

  // --- the next iteration's first groups, gathered during the step ---------------------------------
  /** @brief The step has updated this rank's chunk index @p c (the pass goes in index order):
   *  starts the gathers the plan puts at the step (`gather_plan::step`) whose send buffer, this
   *  rank's chunk of the group, is final now, so they travel while the step goes on. */
  void stepped(std::size_t c);
  /** @brief The step has ended: starts the rest of them (a group this rank owns no chunk of). */
  void step_done();
  /** @brief Parameters written outside a scope (write_tensor, a checkpoint loaded): gathers in
   *  flight complete first (this rank's chunk may be their send buffer), and the groups gathered
   *  for the next iteration, holding the old values, go. Other ranks may hold theirs: the next
   *  scope's prepare() agrees (see agree_on_next). */
  void params_written() noexcept;
  /** @brief Waits for every gather in flight (their send buffers, this rank's chunks, unpinned);
   *  the groups stay gathered. */
  void settle_gathers();
  /** @brief settle_gathers() without throwing: a gather that failed is released (the communicator
   *  reports the failure at its next collective). */
  void settle_gathers_quietly() noexcept {
    try {
      settle_gathers();
    } catch (...) {  // finish_gather released every gather in flight
    }
  }

  /** @brief Whether chunk @p c's gradient is this rank's to step now: it owns the chunk and its
   *  unit neither collects contributions nor is being reduced (its reduction has completed, or it
   *  had none). Without sharding: always. */
  [[nodiscard]] bool gradient_in_place(std::size_t c) const noexcept {
    if (!active()) return true;
    if (!map().owns(c)) return false;
    const group_state& g = groups_[unit_of(c)];
    return !g.accumulating && !g.reducing;
  }
  /** @brief Whether chunk @p c's parameters are gathered for this iteration's scopes: every rank
   *  holds a copy of its group, so a write on one rank would leave the others' copies stale (or,
   *  for another rank's chunk, be lost when this rank's copy is released). A group the step
   *  gathered for the next iteration does not count: params_written() lets it go. */
  [[nodiscard]] bool gathered_for_use(std::size_t c) const noexcept {
    if (!active()) return false;
    const std::size_t g = unit_of(c);
    return g < groups_.size() && groups_[g].gathered && !groups_[g].for_next;
  }
  /** @brief Whether chunk @p c's unit has a reduction in flight (its gradient is not final yet). */
  [[nodiscard]] bool reducing(std::size_t c) const noexcept { return active() && groups_[unit_of(c)].reducing; }
  /** @brief How many consecutive chunks are gathered and reduced as one: a group (N ranks) in the
   *  group mode; 1 in the memory-saving mode or without sharding. */
  [[nodiscard]] std::size_t used_together() const noexcept {
    return active() && !memory_saving() ? static_cast<std::size_t>(comm_.size()) : 1;
  }

  /** @brief Called with this rank's parameter chunk before it is made resident as a collective's
   *  send buffer (a group's allgather, a memory-saving broadcast): the runtime waits there for an
   *  early optimizer update still holding it (the last step's, running into this forward). */
  std::function<void(chunk_id)> before_send;

  /** @brief True while gradients collect in group buffers or travel to their owners (between the
   *  micro-batches of a step): what `drop()` would lose. */
  [[nodiscard]] bool gradients_open() const noexcept {
    for (const auto& g : groups_)
      if (g.accumulating || g.reducing) return true;
    return !in_flight_.empty();
  }

 private:
  /** A unit's state: a group of N chunks, or one chunk in the memory-saving mode. */
  struct group_state {
    bool gathered = false;      // its parameters are on the compute tier for use
    void* params = nullptr;     // their buffer (remote chunks attached; none for an owner's own chunk)
    bool accumulating = false;  // its gradients collect contributions
    void* grads = nullptr;      // their buffer (chunks without a payload attached; none for a payload of its own)
    bool reducing = false;      // its reduce-scatter is in flight (grads is its send buffer until done)
    bool gathering = false;     // its allgather, started ahead, is in flight (params is its receive buffer)
    std::size_t hold_until = never;  // gathered ahead for this moment: kept until it has used the group
    bool for_next = false;           // gathered during the step for the next iteration's first scope
  };

  /** An allgather started ahead of its moment; this rank's chunk, its send buffer, stays pinned. */
  struct gather_in_flight {
    std::size_t group = 0;
    typename Store::pin_set own;
    comm_handle done;  // declared after `own`: destroyed (waited for) before the chunk is unpinned
  };

  /** A reduce-scatter started and not yet completed: it runs while the next scope computes. */
  struct reduction_in_flight {
    std::size_t group = 0;
    typename Store::pin_set own;  // memory-saving mode: the owner's own gradient payload, reduced in place
    comm_handle done;
    void* result = nullptr;         // scratch receiving this rank's reduced chunk
    std::vector<float> send, recv;  // fp32 staging when 16-bit gradients are reduced in fp32
  };

  /** Room for @p bytes more on the compute tier. Reductions in flight hold their buffers; rather
   *  than evict chunks for room they would give back, they are completed first (waiting issues no
   *  collective, so the ranks' sequences of collectives stay the same). */
  void room(std::size_t bytes, std::string_view who, std::string_view what);

  [[nodiscard]] bool memory_saving() const noexcept { return options_.memory_saving; }
  /** The unit chunk @p c is gathered and reduced with: its group; itself in the memory-saving mode. */
  [[nodiscard]] std::size_t unit_of(std::size_t c) const { return memory_saving() ? c : map().group(c); }
  [[nodiscard]] std::size_t first_of(std::size_t u) const { return memory_saving() ? u : map().first(u); }
  [[nodiscard]] std::size_t unit_size(std::size_t u) const { return memory_saving() ? 1 : group_size(u); }
  [[nodiscard]] std::size_t group_size(std::size_t g) const;
  [[nodiscard]] std::vector<chunk_id> remote_members(std::size_t g) const;
  [[nodiscard]] std::vector<chunk_id> members(chunk_kind k, std::size_t u) const;
  /** Whether every gradient chunk of group @p g gets no more contributions after moment @p m: from
   *  the trace, or in the first iteration from the uses counted so far. Chunks no scope uses
   *  (padding, parameters outside every scope) never hold a contribution: final either way. */
  [[nodiscard]] bool all_final(std::size_t g, std::size_t m) const;

  /** Plans the gathers ahead for the adopted trace, from this rank's budgets; the ranks then agree
   *  on the moments every one of them accepted (allreduce of min over 0/1 per moment). */
  void make_plan();

  /** This rank's parameter chunk in group @p g: its part of the group's allgather. */
  [[nodiscard]] chunk_id own_param(std::size_t g) const {
    return {chunk_kind::param, static_cast<std::uint32_t>(map().first(g) + static_cast<std::size_t>(comm_.rank()))};
  }
  /** Readies group @p g's allgather: this rank's chunk, the send buffer, made resident and held in
   *  @p pin; room made and the receive buffer attached (returned). */
  void* gather_buffer(std::size_t g, typename Store::pin_set& pin, std::string_view who, std::size_t m);
  /** Starts the allgather of group @p g (see gather()); completed by finish_gather(). */
  void start_gather(std::size_t g, std::string_view who, std::size_t m);

  /** Waits for group @p g's allgather started ahead. If it failed, every gather in flight is
   *  discarded (their groups released) and the error rethrown. */
  void finish_gather(std::size_t g);

  /** Waits quietly for every gather in flight and releases its group. */
  void discard_gathers() noexcept;

  /** Whether this step gathers for the next iteration: the plan, made for the current trace, says so. */
  [[nodiscard]] bool gathers_at_step() const {
    return active() && plan_key_ == tracer_.stats().traces && plan_.step != never;
  }
  /** Starts the step's gathers for the next iteration up to (not including) position @p end of
   *  the plan's list, in its order: every rank starts the same ones in the same order. */
  void start_step_gathers(std::size_t end);
  /** The first scope after a step that gathered for the next iteration, before any collective of
   *  its own: the ranks agree (one allreduce of a flag, min) whether every rank still holds those
   *  groups as gathered; a rank that wrote parameters, slept or dropped them since says no, and
   *  then every rank releases them and gathers again on use. One collective per iteration, issued
   *  by every rank at the same call, so the ranks' sequences stay the same. */
  void agree_on_next();

  /** Allgathers group @p g's parameters: this rank's chunk (made resident first: it is the send
   *  buffer) into position rank() of a new group buffer whose other positions are the remote chunks. */
  void gather(std::size_t g, std::string_view who, std::size_t m);

  /** Frees group @p g's gathered parameters; a gather still in flight is waited for first (it
   *  writes into the buffer), quietly. */
  void release(std::size_t g) noexcept;
  /** The moment the plan keeps group @p g for when moment @p m's scope has closed (gather_plan::keep);
   *  never: released as usual. */
  [[nodiscard]] std::size_t kept_until(std::size_t g, std::size_t m) const;

  /** Gives the gradients of group @p g a zeroed group buffer (the owned one too, unless an earlier
   *  reduction this iteration left it a payload: new contributions then add into that). */
  void attach_gradients(std::size_t g, std::string_view who);

  /** Starts the reduce-scatter of group @p g's gradients: the owner of each chunk will receive the
   *  rank-order sum of every rank's contribution (completed by finish_reductions()). */
  void start_reduction(std::size_t g);

  /** Completes every reduction in flight, in the order they started: the owner's chunk adopts
   *  (or adds) the reduced values and the group's gradient buffer is freed. If one failed, the
   *  rest are discarded as by drop() and the error is rethrown. */
  void finish_reductions();

  /** Waits for every reduction in flight (a collective may still write its buffers) and discards
   *  its result; the groups' gradient buffers stay attached. */
  void discard_in_flight() noexcept;

  void complete(reduction_in_flight& r);

  // --- the memory-saving mode (PatrickStar's MSC): one chunk at a time, owner to all and back ---

  /** Brings parameter chunk @p id to every rank: a broadcast from its owner (whose payload, made
   *  resident and pinned, is the send buffer) into a one-chunk buffer on every other rank. */
  void fetch(chunk_id id, std::string_view who, std::size_t m);

  /** Gives gradient chunk @p id a zeroed one-chunk buffer on every rank (its owner's too, unless
   *  an earlier reduction this iteration left it a payload: contributions then add into that). */
  void attach_gradient(chunk_id id, std::string_view who);

  /** Waits (on the host) for the user's work still writing unit @p u's gradients: a scope closed
   *  on a stream hands back kernels that may still run, and the communicator reads the buffer on
   *  its own stream (NCCL) or from the host (staging), ordered after nothing of the user's. */
  void wait_for_user(std::size_t u);

  /** Starts the reduction of gradient chunk @p c to its owner, in place on the owner (every
   *  communicator sums in rank order, so the owner's sum has the bits of the group mode's
   *  reduce-scatter, and N such reductions move what one reduce-scatter of N chunks does). */
  void start_chunk_reduction(std::size_t c);

  /** Completes a chunk's reduction: the owner keeps the sum as its gradient payload, the other
   *  ranks free their buffer. */
  void complete_chunk_reduction(reduction_in_flight& r);

  Store& store_;
  group_buffers<Store> buffers_;  // the group and scratch buffers of its collectives
  Residency& residency_;
  const TracerT& tracer_;
  Comm& comm_;
  sharding_options options_;
  runtime_stats& stats_;
  const compute_level& level_;
  std::vector<group_state> groups_;
  struct use_count {
    std::uint32_t forward = 0, backward = 0;
  };
  /** What the first iteration counts while it has no trace (gradient_final_untraced); reset when it ends. */
  struct untraced_counts {
    std::vector<use_count> uses;  // per chunk
    int micro_batch = 0;          // micro-batches begun before this one (a forward after a backward begins one)
    bool after_backward = false;  // the last traced scope was a backward one
    std::vector<std::uint32_t> first_backward;  // each chunk's backward uses in the first micro-batch
  };
  std::string last_scope_;  // the last scope prepared: what a reduction started after it is named by
  untraced_counts first_;
  std::vector<reduction_in_flight> in_flight_;  // in the order started
  std::vector<gather_in_flight> gathering_;     // gathers started ahead, in the order started
  gather_plan plan_;                            // the gathers ahead of the adopted trace
  std::size_t plan_key_ = never;                // tracer_stats::traces when plan_ was made
  std::size_t closed_at_ = never;               // the moment of the last scope closed, until settle()
  bool closed_untraced_ = false;                // it was closed inside an untraced section
  std::size_t step_started_ = 0;                // of the plan's step gathers, those started in this step
  bool agree_next_ = false;                     // the step gathered for the next iteration: agree first
  bool next_intact_ = true;                     // and this rank still holds all of them
};

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
std::vector<chunk_id> shard_manager<Store, Residency, TracerT, Comm>::prepare(std::span<const chunk_id> ids,
                                                                              moment_kind kind, std::string_view who,
                                                                              std::size_t m) {
  std::vector<chunk_id> owned;
  if (!active()) return {ids.begin(), ids.end()};
  if (agree_next_) agree_on_next();
  last_scope_.assign(who);
  groups_.resize(unit_of(store_.num_chunks() - 1) + 1);
  // Per unit (a group; one chunk in the memory-saving mode), even where this rank owns the
  // chunk the scope needs: every rank runs this scope, so every rank takes part in the collective.
  if (!tracer_.ready() && !level_.untraced) {  // the first iteration: count uses (gradient_final_untraced)
    first_.uses.resize(store_.num_chunks());
    if (kind == moment_kind::forward && first_.after_backward &&
        first_.micro_batch++ == 0) {  // the first micro-batch ended
      first_.first_backward.resize(first_.uses.size());
      for (std::size_t c = 0; c < first_.uses.size(); ++c) first_.first_backward[c] = first_.uses[c].backward;
    }
    first_.after_backward = kind == moment_kind::backward;
    for (auto id : ids)
      if ((kind == moment_kind::forward) == (id.kind == chunk_kind::param))
        ++(kind == moment_kind::forward ? first_.uses[id.index].forward : first_.uses[id.index].backward);
  }
  for (auto id : ids) {
    const std::size_t g = unit_of(id.index);
    if (groups_[g].gathering && id.kind == chunk_kind::param) finish_gather(g);  // started a moment ago
    if (id.kind == chunk_kind::grad) {
      if (groups_[g].reducing) finish_reductions();  // gradients again after their reduction (a divergent iteration)
      if (!groups_[g].accumulating) memory_saving() ? attach_gradient(id, who) : attach_gradients(g, who);
      if (groups_[g].grads == nullptr) owned.push_back(id);  // its own payload, from an earlier reduction
    } else {
      if (!groups_[g].gathered) memory_saving() ? fetch(id, who, m) : gather(g, who, m);
      if (map().owns(id.index)) owned.push_back(id);
    }
  }
  // The owned chunks come next (the demand path): as for a group buffer (room()), reductions in
  // flight complete before chunks are evicted for room they would give back. A group gathered
  // ahead or kept takes no room() here, so this is the only chance.
  std::size_t missing = 0;
  for (auto id : owned)
    if (store_.at(id).where != tier::device) missing += store_.bytes_of(id.kind);
  if (missing > 0 && !in_flight_.empty() && store_.device_in_use() + missing > residency_.budget_now())
    finish_reductions();
  return owned;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::gather_ahead(std::size_t m, std::string_view who) {
  if (!active() || !options_.gather_ahead || memory_saving() || m == never || level_.untraced || !tracer_.ready())
    return;
  if (plan_key_ != tracer_.stats().traces) make_plan();
  if (!plan_.starts_ahead(m)) return;
  for (std::size_t i = 0; i < plan_.ahead[m].size(); ++i) {
    const std::size_t g = plan_.ahead[m][i];
    if (g >= groups_.size() || groups_[g].gathered) continue;
    start_gather(g, who, m);
    groups_[g].hold_until = plan_.until[m][i];
    if (plan_.until[m][i] > m + 1) ++stats_.gathers_further;
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::closed(std::size_t m) noexcept {
  closed_at_ = m;
  closed_untraced_ = level_.untraced;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::settle() {
  if (closed_at_ != never) after_close(std::exchange(closed_at_, never), closed_untraced_);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::finish_backward() {
  close_backward();
  finish_reductions();
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
bool shard_manager<Store, Residency, TracerT, Comm>::finish_one_reduction() {
  if (in_flight_.empty()) return false;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    complete(in_flight_.front());
    in_flight_.erase(in_flight_.begin());
  } catch (...) {
    discard_in_flight();  // their gradient groups stay attached, unreduced, as drop() expects
    throw;
  }
  stats_.reduce_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return true;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::after_close(std::size_t m, bool untraced) {
  if (!active()) return;
  finish_reductions();  // started one scope ago: they ran while that scope computed
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (untraced) {  // evaluation, sampling: the training trace says nothing about these scopes
      if (groups_[g].gathered) release(g);
      continue;
    }
    if (groups_[g].accumulating && !groups_[g].reducing && all_final(g, m)) start_reduction(g);
    if (groups_[g].hold_until != never && groups_[g].hold_until <= m) groups_[g].hold_until = never;
    if (groups_[g].gathered && groups_[g].hold_until == never &&  // one gathered ahead waits for its moment
        release_gathered(tracer_, members(chunk_kind::param, g), m, options_.keep_gathered)) {
      if (const std::size_t until = kept_until(g, m); until != never) {  // the plan keeps it: no gather again
        groups_[g].hold_until = until;
        ++stats_.gathers_kept;
      } else {
        release(g);
      }
    }
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
std::size_t shard_manager<Store, Residency, TracerT, Comm>::kept_until(std::size_t g, std::size_t m) const {
  // The plan of this trace only (made at the iteration's first scope; gather_ahead's conditions).
  if (!options_.gather_ahead || memory_saving() || plan_key_ != tracer_.stats().traces || m >= plan_.keep.size())
    return never;
  const auto& keep = plan_.keep[m];
  const auto it = std::find(keep.begin(), keep.end(), g);
  return it == keep.end() ? never : plan_.keep_until[m][static_cast<std::size_t>(it - keep.begin())];
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::close_backward() {
  settle();
  if (!active()) return;
  first_ = {};
  // Every rank steps: groups the last step gathered and nothing used go on every rank alike.
  step_started_ = 0;
  agree_next_ = false;
  next_intact_ = true;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].accumulating && !groups_[g].reducing) start_reduction(g);
    if (groups_[g].gathered) release(g);
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::drop(bool keep_next) noexcept {
  closed_at_ = never;
  first_ = {};
  discard_in_flight();
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].grads) buffers_.detach(std::exchange(groups_[g].grads, nullptr), tier::remote);
    groups_[g].accumulating = false;
    if (groups_[g].gathered && !(keep_next && groups_[g].for_next)) {
      if (groups_[g].for_next) next_intact_ = false;
      release(g);
    }
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::stepped(std::size_t c) {
  if (!gathers_at_step()) return;
  const auto& groups = plan_.ahead[plan_.step];
  const std::size_t r = static_cast<std::size_t>(comm_.rank());
  std::size_t end = step_started_;  // this rank's chunk of each group (its first, if none) stepped by now
  while (end < groups.size() && map().first(groups[end]) + (r < group_size(groups[end]) ? r : 0) <= c) ++end;
  start_step_gathers(end);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::step_done() {
  if (gathers_at_step()) start_step_gathers(plan_.ahead[plan_.step].size());
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::start_step_gathers(std::size_t end) {
  for (; step_started_ < end; ++step_started_) {
    const std::size_t g = plan_.ahead[plan_.step][step_started_];
    agree_next_ = true;  // from the first one on: a step that throws after it still agrees before use
    if (g >= groups_.size() || groups_[g].gathered) continue;
    start_gather(g, "optimizer", tracer_.current_moment());
    groups_[g].hold_until = plan_.until[plan_.step][step_started_];
    groups_[g].for_next = true;
    ++stats_.gathers_at_step;
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::agree_on_next() {
  agree_next_ = false;
  double held[] = {next_intact_ ? 1.0 : 0.0};
  next_intact_ = true;
  comm_.allreduce(std::span<double>(held), reduce_op::min);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (!groups_[g].for_next) continue;
    groups_[g].for_next = false;  // from here on a group gathered ahead like any other
    if (held[0] < 0.5) release(g);
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::params_written() noexcept {
  settle_gathers_quietly();  // a gather in flight may be sending the chunk about to be written
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].for_next) {
      next_intact_ = false;
      release(g);
    }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::settle_gathers() {
  while (!gathering_.empty()) finish_gather(gathering_.front().group);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::room(std::size_t bytes, std::string_view who,
                                                          std::string_view what) {
  if (!in_flight_.empty() && store_.device_in_use() + bytes > residency_.budget_now()) finish_reductions();
  residency_.make_room(bytes, who, what);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
std::size_t shard_manager<Store, Residency, TracerT, Comm>::group_size(std::size_t g) const {
  return std::min<std::size_t>(static_cast<std::size_t>(comm_.size()), store_.num_chunks() - map().first(g));
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
std::vector<chunk_id> shard_manager<Store, Residency, TracerT, Comm>::remote_members(std::size_t g) const {
  std::vector<chunk_id> v;
  for (std::size_t k = 0; k < group_size(g); ++k)
    if (static_cast<int>(k) != comm_.rank())
      v.push_back({chunk_kind::param, static_cast<std::uint32_t>(map().first(g) + k)});
  return v;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
std::vector<chunk_id> shard_manager<Store, Residency, TracerT, Comm>::members(chunk_kind k, std::size_t u) const {
  std::vector<chunk_id> v;
  for (std::size_t c = 0; c < unit_size(u); ++c) v.push_back({k, static_cast<std::uint32_t>(first_of(u) + c)});
  return v;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
bool shard_manager<Store, Residency, TracerT, Comm>::all_final(std::size_t g, std::size_t m) const {
  for (std::size_t k = 0; k < unit_size(g); ++k) {
    const std::size_t c = first_of(g) + k;
    if (tracer_.ready()) {
      if (!gradient_final(tracer_, {chunk_kind::grad, static_cast<std::uint32_t>(c)}, m)) return false;
    } else if (first_.micro_batch + 1 < options_.micro_batches) {  // more micro-batches add to it before the step
      return false;
    } else if (c < first_.first_backward.size() &&
               first_.first_backward[c] > 0) {  // the last micro-batch adds as the first did
      if (first_.uses[c].backward < static_cast<std::uint32_t>(options_.micro_batches) * first_.first_backward[c])
        return false;
    } else if (c < first_.uses.size() && (first_.uses[c].forward > 0 || first_.uses[c].backward > 0) &&
               !gradient_final_untraced(first_.uses[c].forward, first_.uses[c].backward)) {
      return false;
    }
  }
  return true;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::make_plan() {
  const auto trace = sharding_trace_of(tracer_);
  gather_plan_inputs in{.map = map(),
                        .param_chunk_bytes = store_.bytes_of(chunk_kind::param),
                        .grad_chunk_bytes = store_.has(chunk_kind::grad) ? store_.bytes_of(chunk_kind::grad) : 0,
                        .keep_gathered = options_.keep_gathered,
                        .depth = static_cast<std::size_t>(std::max(options_.gather_depth, 1)),
                        .at_step = options_.gather_at_step,
                        .budget = {}};
  for (std::size_t m = 0; m < trace.size(); ++m) in.budget.push_back(residency_.planned_budget(m));
  // At the step's moments, what a chunk stepped on the compute tier holds there is not the gathers'.
  for (const auto& a : tracer_.accesses())
    if (a.moment < trace.size() && trace.kinds[a.moment] == moment_kind::optimizer)
      in.budget[a.moment] -= std::min(in.budget[a.moment], store_.bytes_of(a.id.kind));
  // The depth every rank accepts at each moment (the minimum over ranks). At depth 1 one round
  // settles it (gather_plan.hpp). Deeper, each round also carries the maximum (as a minimum of
  // negated depths): where the ranks' depths differ, they plan again under the minimum, until
  // every rank accepts the same depths (each round can only lower them; every rank computes the
  // same sequence of rounds).
  const std::size_t M = trace.size();
  std::vector<std::size_t> agreed;  // empty: as deep as in.depth everywhere
  for (;;) {
    const auto mine = plan_gathers(trace, in, agreed);
    std::vector<double> v(in.depth > 1 ? 2 * M : M);
    for (std::size_t m = 0; m < M; ++m) {
      v[m] = static_cast<double>(mine.depth[m]);
      if (in.depth > 1) v[M + m] = -v[m];
    }
    comm_.allreduce(std::span<double>(v), reduce_op::min);
    bool settled = true;
    agreed.assign(M, 0);
    for (std::size_t m = 0; m < M; ++m) {
      agreed[m] = static_cast<std::size_t>(v[m] + 0.5);
      if (in.depth > 1 && v[m] != -v[M + m]) settled = false;
    }
    if (settled) break;
  }
  plan_ = plan_gathers(trace, in, agreed);
  plan_key_ = tracer_.stats().traces;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void* shard_manager<Store, Residency, TracerT, Comm>::gather_buffer(std::size_t g, typename Store::pin_set& pin,
                                                                    std::string_view who, std::size_t m) {
  const chunk_id own = own_param(g);
  const chunk_id own_ids[] = {own};
  if (before_send) before_send(own);
  store_.wait_user(store_.at(own));  // an update still running on a stream (the step's) writes it
  residency_.make_resident_on_device(own_ids, who, m);
  pin = typename Store::pin_set(store_, {own});
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  room(n * store_.bytes_of(chunk_kind::param), who, "its gathered parameters (a ZeRO group of one chunk per rank)");
  const auto members = remote_members(g);
  std::vector<std::size_t> at;
  for (auto id : members) at.push_back(id.index - map().first(g));
  return buffers_.attach(members, at, n, /*zero=*/false);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::start_gather(std::size_t g, std::string_view who, std::size_t m) {
  const std::size_t n = static_cast<std::size_t>(comm_.size()), b = store_.bytes_of(chunk_kind::param);
  const chunk_id own = own_param(g);
  gather_in_flight r{.group = g, .own = {}, .done = {}};
  void* base = gather_buffer(g, r.own, who, m);
  try {
    r.done = comm_.allgather_async(store_.at(own).data, base, b);
  } catch (...) {
    buffers_.detach(base, tier::remote);
    throw;
  }
  gathering_.push_back(std::move(r));
  groups_[g].params = base;
  groups_[g].gathered = groups_[g].gathering = true;
  ++stats_.gathers;
  ++stats_.gathers_ahead;
  stats_.bytes_gathered += (n - 1) * b;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::finish_gather(std::size_t g) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto it = std::find_if(gathering_.begin(), gathering_.end(), [&](const auto& r) { return r.group == g; });
  groups_[g].gathering = false;
  if (it == gathering_.end()) return;
  try {
    it->done.wait();
  } catch (...) {
    discard_gathers();
    throw;
  }
  gathering_.erase(it);
  stats_.gather_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::discard_gathers() noexcept {
  while (!gathering_.empty()) release(gathering_.back().group);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::gather(std::size_t g, std::string_view who, std::size_t m) {
  const std::size_t n = static_cast<std::size_t>(comm_.size()), b = store_.bytes_of(chunk_kind::param);
  const chunk_id own = own_param(g);
  typename Store::pin_set pin;
  void* base = gather_buffer(g, pin, who, m);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    comm_.allgather(store_.at(own).data, base, b);
  } catch (...) {
    buffers_.detach(base, tier::remote);
    throw;
  }
  stats_.gather_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  groups_[g].params = base;
  groups_[g].gathered = true;
  ++stats_.gathers;
  stats_.bytes_gathered += (n - 1) * b;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::release(std::size_t g) noexcept {
  groups_[g].gathering = false;
  const auto it = std::find_if(gathering_.begin(), gathering_.end(), [&](const auto& r) { return r.group == g; });
  if (it != gathering_.end()) {
    it->done = comm_handle{};  // assigning over a pending handle waits for it, quietly
    gathering_.erase(it);      // unpins this rank's chunk
  }
  if (groups_[g].params) buffers_.detach(std::exchange(groups_[g].params, nullptr), tier::remote);
  groups_[g].gathered = false;
  groups_[g].hold_until = never;
  groups_[g].for_next = false;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::attach_gradients(std::size_t g, std::string_view who) {
  const std::size_t n = static_cast<std::size_t>(comm_.size());
  std::vector<chunk_id> members;
  std::vector<std::size_t> at;
  for (std::size_t k = 0; k < group_size(g); ++k) {
    const chunk_id id{chunk_kind::grad, static_cast<std::uint32_t>(map().first(g) + k)};
    if (holds_payload(store_.at(id).where)) continue;
    members.push_back(id);
    at.push_back(k);
  }
  room(n * store_.bytes_of(chunk_kind::grad), who,
       "its gradient buffers (a ZeRO group of one chunk per rank, summed over the ranks after backward)");
  groups_[g].grads = buffers_.attach(members, at, n, /*zero=*/true);
  groups_[g].accumulating = true;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::start_reduction(std::size_t g) {
  if (memory_saving()) return start_chunk_reduction(g);
  const std::size_t n = static_cast<std::size_t>(comm_.size()), b = store_.bytes_of(chunk_kind::grad);
  const dtype t = store_.desc(chunk_kind::grad).type;
  const std::size_t elems = b / dtype_size(t);
  // fp32 staging on the host: for host-accessible devices (the simulated one). A CUDA device
  // reduces in the gradient dtype through its communicator (NCCL accumulates in it).
  const bool widen = Store::device_is_host_accessible && t != dtype::f32 && options_.reduce_in_fp32;
  wait_for_user(g);
  room(b, last_scope_, "the result of a gradient group's reduction (ZeRO), after its backward");
  reduction_in_flight r;
  r.group = g;
  r.result = buffers_.allocate_scratch(b);
  try {
    if (widen) {  // each contribution widened (exactly), summed in fp32 in rank order, rounded once
      r.send.resize(n * elems);
      r.recv.resize(elems);
      widen_to_float(static_cast<const std::byte*>(groups_[g].grads), t, r.send);
      r.done = comm_.reduce_scatter_async(r.send.data(), r.recv.data(), elems, dtype::f32, reduce_op::sum);
    } else {
      r.done = comm_.reduce_scatter_async(groups_[g].grads, r.result, elems, t, reduce_op::sum);
    }
    in_flight_.push_back(std::move(r));
  } catch (...) {
    r.done = comm_handle{};
    buffers_.free_scratch(r.result, b);
    throw;
  }
  groups_[g].reducing = true;
  ++stats_.reductions;
  stats_.bytes_reduced += (n - 1) * (widen ? elems * sizeof(float) : b);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::finish_reductions() {
  while (finish_one_reduction()) {
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::discard_in_flight() noexcept {
  for (auto& r : in_flight_) {
    r.done = comm_handle{};  // assigning over a pending handle waits for it, quietly
    if (r.result) buffers_.free_scratch(r.result, store_.bytes_of(chunk_kind::grad));
    groups_[r.group].reducing = false;
  }
  in_flight_.clear();
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::complete(reduction_in_flight& r) {
  if (memory_saving()) return complete_chunk_reduction(r);
  const std::size_t g = r.group, b = store_.bytes_of(chunk_kind::grad);
  const dtype t = store_.desc(chunk_kind::grad).type;
  const std::size_t elems = b / dtype_size(t);
  const chunk_id own{chunk_kind::grad,
                     static_cast<std::uint32_t>(map().first(g) + static_cast<std::size_t>(comm_.rank()))};
  r.done.wait();
  if (!r.recv.empty()) narrow_from_float(r.recv, t, static_cast<std::byte*>(r.result));
  const bool own_had_payload = store_.at(own).group == nullptr && holds_payload(store_.at(own).where);
  buffers_.detach(std::exchange(groups_[g].grads, nullptr), tier::remote);
  groups_[g].reducing = groups_[g].accumulating = false;
  if (own_had_payload) {  // contributions after an earlier reduction (a divergent iteration): add
    std::vector<float> a(elems), sum(elems);
    chunk_values(store_).read(own, 0, a);
    widen_to_float(static_cast<const std::byte*>(r.result), t, sum);
    for (std::size_t i = 0; i < elems; ++i) a[i] += sum[i];
    chunk_values(store_).write(own, 0, a);
    buffers_.free_scratch(std::exchange(r.result, nullptr), b);
  } else {
    buffers_.adopt(own, std::exchange(r.result, nullptr));
  }
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::fetch(chunk_id id, std::string_view who, std::size_t m) {
  const std::size_t b = store_.bytes_of(chunk_kind::param);
  const int root = map().owner(id.index);
  auto& unit = groups_[id.index];
  if (root == comm_.rank()) {
    const chunk_id own_ids[] = {id};
    if (before_send) before_send(id);
    residency_.make_resident_on_device(own_ids, who, m);
    typename Store::pin_set pin(store_, {id});
    comm_.broadcast(store_.at(id).data, b, root);
  } else {
    room(b, who, "a parameter chunk broadcast from its owner (ZeRO memory-saving mode)");
    const chunk_id ids[] = {id};
    const std::size_t at[] = {0};
    void* buf = buffers_.attach(ids, at, 1, /*zero=*/false);
    try {
      comm_.broadcast(buf, b, root);
    } catch (...) {
      buffers_.detach(buf, tier::remote);
      throw;
    }
    unit.params = buf;
    stats_.bytes_gathered += b;
  }
  unit.gathered = true;
  ++stats_.gathers;
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::attach_gradient(chunk_id id, std::string_view who) {
  auto& unit = groups_[id.index];
  unit.accumulating = true;
  if (holds_payload(store_.at(id).where)) return;  // the owner's, reduced once already
  room(store_.bytes_of(chunk_kind::grad), who, "a gradient chunk reduced to its owner (ZeRO memory-saving mode)");
  const chunk_id ids[] = {id};
  const std::size_t at[] = {0};
  unit.grads = buffers_.attach(ids, at, 1, /*zero=*/true);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::wait_for_user(std::size_t u) {
  for (auto id : members(chunk_kind::grad, u)) store_.wait_user(store_.at(id));
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::start_chunk_reduction(std::size_t c) {
  const chunk_id id{chunk_kind::grad, static_cast<std::uint32_t>(c)};
  const dtype t = store_.desc(chunk_kind::grad).type;
  const std::size_t b = store_.bytes_of(chunk_kind::grad), elems = b / dtype_size(t);
  const bool widen = Store::device_is_host_accessible && t != dtype::f32 && options_.reduce_in_fp32;
  wait_for_user(c);
  reduction_in_flight r;
  r.group = c;
  if (groups_[c].grads == nullptr) {  // its own payload: in memory (a disk tier may have sent it down), kept in place
    if (store_.at(id).where == tier::disk) residency_.make_resident_on_host(id);
    r.own = typename Store::pin_set(store_, {id});
  }
  void* data = store_.at(id).data;
  const int root = map().owner(c);
  if (widen) {
    r.send.resize(elems);
    widen_to_float(static_cast<const std::byte*>(data), t, r.send);
    r.done = comm_.reduce_async(r.send.data(), r.send.data(), elems, dtype::f32, reduce_op::sum, root);
  } else {
    r.done = comm_.reduce_async(data, data, elems, t, reduce_op::sum, root);
  }
  in_flight_.push_back(std::move(r));
  groups_[c].reducing = true;
  ++stats_.reductions;
  if (!map().owns(c)) stats_.bytes_reduced += (widen ? elems * sizeof(float) : b);
}

template <class Store, class Residency, Tracer TracerT, Communicator Comm>
void shard_manager<Store, Residency, TracerT, Comm>::complete_chunk_reduction(reduction_in_flight& r) {
  const std::size_t c = r.group;
  const chunk_id id{chunk_kind::grad, static_cast<std::uint32_t>(c)};
  r.done.wait();
  auto& unit = groups_[c];
  if (map().owns(c)) {
    if (!r.send.empty())
      narrow_from_float(r.send, store_.desc(chunk_kind::grad).type, static_cast<std::byte*>(store_.at(id).data));
    if (unit.grads) buffers_.ungroup(std::exchange(unit.grads, nullptr));
  } else if (unit.grads) {
    buffers_.detach(std::exchange(unit.grads, nullptr), tier::remote);
  }
  r.own.reset();
  unit.reducing = unit.accumulating = false;
}

}  // namespace chunkstar
