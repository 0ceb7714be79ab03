// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_runtime`: PatrickStar's runtime, a short façade over its components (registry,
 *         tensor states, chunk store, residency manager and prefetch planner, non-model allocator,
 *         optimizer pass) composed with the policies at compile time. See docs/design.md.
 *
 *  Exception safety: after any operation throws, no chunk is left pinned, every chunk is in a
 *  consistent tier, and tensor states are as before the call (a scope that failed to open is not
 *  open). Training may continue: reopen the scope, or call `step` again (it resumes with the chunk
 *  index that failed). The destructor never throws.
 *
 *  Members that do real work are defined after the class, not inside it: they are then not
 *  inline, so a translation unit that sees `extern template class chunk_runtime<...>` (see
 *  runtime/explicit_instantiation.hpp) calls the one compiled copy instead of compiling the runtime again. */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/core/function_ref.hpp>
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/runtime/access_scope.hpp>
#include <chunkstar/store/chunk_store.hpp>
#include <chunkstar/store/chunk_values.hpp>
#include <chunkstar/store/disk_moves.hpp>
#include <chunkstar/runtime/memory_plan.hpp>
#include <chunkstar/runtime/non_model_buffer.hpp>
#include <chunkstar/store/non_model_allocator.hpp>
#include <chunkstar/runtime/optimizer_pass.hpp>
#include <chunkstar/runtime/param_registry.hpp>
#include <chunkstar/memory/platform.hpp>
#include <chunkstar/store/residency_manager.hpp>
#include <chunkstar/runtime/runtime_options.hpp>
#include <chunkstar/zero/shard_manager.hpp>
#include <chunkstar/observe/runtime_observer.hpp>
#include <chunkstar/runtime/tensor_state_table.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief The chunk runtime. @tparam Layout ChunkLayout; Placement PlacementPolicy; Eviction
 *  EvictionStrategy; TracerT Tracer; Comm Communicator (held by reference); P Platform. */
template <ChunkLayout Layout = searched_chunk_layout, PlacementPolicy Placement = auto_placement,
          EvictionStrategy Eviction = belady_eviction, Tracer TracerT = warmup_tracer,
          Communicator Comm = single_process_communicator, Platform P = simulated_platform>
class chunk_runtime {
 public:
  using platform_type = P;
  using device_space_type = typename P::device_space;
  using host_space_type = typename P::host_space;
  using copy_engine_type = typename P::copy_engine;
  using stream_type = typename P::stream_type;
  using layout_type = Layout;
  using placement_type = Placement;
  using eviction_type = Eviction;
  using tracer_type = TracerT;
  using communicator_type = Comm;
  using store_type = chunk_store<P>;
  using scope = access_scope<chunk_runtime>;  ///< see access_scope.hpp (and its stream contract)
  using untraced_section = chunkstar::untraced_section<chunk_runtime>;
  /** @brief An optimizer update as the step pass runs it: done when it returns, or still running on
   *  the returned stream (see step()). */
  using update_ref = function_ref<std::optional<stream_type>(const step_chunk&)>;

  /** @brief A runtime with its own default communicator (one process). */
  chunk_runtime(device_space_type& device, host_space_type& host, copy_engine_type& copier,
                runtime_options options = {}, Layout layout = Layout(), Placement placement = Placement(),
                Eviction eviction = Eviction(), TracerT tracer = TracerT()) requires std::default_initializable<Comm>
      : chunk_runtime(device, host, copier, nullptr, options, std::move(layout), std::move(placement),
                      std::move(eviction), std::move(tracer)) {}
  /** @brief A runtime over the user's communicator @p comm, which must outlive it (like the spaces). */
  chunk_runtime(device_space_type& device, host_space_type& host, copy_engine_type& copier, Comm& comm,
                runtime_options options = {}, Layout layout = Layout(), Placement placement = Placement(),
                Eviction eviction = Eviction(), TracerT tracer = TracerT())
      : chunk_runtime(device, host, copier, &comm, options, std::move(layout), std::move(placement),
                      std::move(eviction), std::move(tracer)) {}
  chunk_runtime(const chunk_runtime&) = delete;
  chunk_runtime& operator=(const chunk_runtime&) = delete;
  ~chunk_runtime();

  /** @brief Adds a third tier on local disk (before finalize): chunks the device and the host
   *  budgets cannot hold live in @p disk's space, moved to and from the host by its engine, the
   *  host's room made by sending down what is needed latest (docs/disk.md). The host budget is
   *  the host space's capacity. With ZeRO sharding each rank's own share spills to its own disk.
   *  @throws state_error after finalize() or a second time. */
  void attach_disk(disk_tier disk);
  [[nodiscard]] bool has_disk() const noexcept { return store_.has_disk(); }

  // --- registration ------------------------------------------------------------------------------
  /** @brief Registers a parameter; @p init fills its fp32 initial values (zeros when empty).
   *  @throws state_error after finalize(); config_error for a duplicate name or another dtype. */
  param_id register_param(tensor_spec spec, param_initializer init = {});

  /** @brief Lays out the parameters (the plan is validated: config_error naming the tensor and the
   *  chunk for a plan that breaks a law), allocates the chunk lists (on the host, spilling to the
   *  compute tier when the host is full) and initialises parameters and optimizer state. With
   *  several ranks, collective: every rank must agree on the runtime's configuration
   *  (describe_configuration) and on @p run, the fields a trainer adds (its seed, data, schedule,
   *  steps... see require_agreement): a difference is one config_error on every rank naming the
   *  field and both ranks' values, before any collective that depends on it.
   *  After a throw the runtime cannot be finalised again: destroy it. */
  void finalize(std::span<const config_field> run = {});

  // --- access scopes -----------------------------------------------------------------------------
  /** @brief Opens a forward scope named @p name over @p params (a moment of the trace). */
  [[nodiscard]] scope forward(std::string_view name, std::vector<param_id> params) {
    return open_scope(moment_kind::forward, name, std::move(params));
  }
  /** @brief Opens a backward scope: params and (zero-initialised on first use) grads resident. */
  [[nodiscard]] scope backward(std::string_view name, std::vector<param_id> params) {
    return open_scope(moment_kind::backward, name, std::move(params));
  }

  // --- non-model memory on the compute tier ------------------------------------------------------
  /** @brief Allocates activation / workspace memory on the compute tier, evicting chunks not in use
   *  if needed; the runtime's accounting and the tracer see it. Memory allocated between iterations
   *  (an input batch before the first scope) counts towards the next iteration's first moment. */
  void* allocate_non_model(std::size_t bytes, std::size_t alignment = 64);
  /** @brief Frees memory from allocate_non_model. The budget of the rest of the moment may rise
   *  (the trace knows what the moment still allocates), so the next chunks start loading now —
   *  into this memory, possibly: on a device with its own streams (CUDA) free it only once the
   *  kernels that use it are done. */
  void deallocate_non_model(void* p, std::size_t bytes, std::size_t alignment = 64) noexcept;
  /** @brief @p count elements of non-model memory as an RAII buffer. */
  template <class T>
  [[nodiscard]] non_model_buffer<T, chunk_runtime> allocate_buffer(std::size_t count, std::size_t alignment = 64) {
    return {*this, count, alignment};
  }

  // --- optimizer step and iteration boundaries ---------------------------------------------------
  /** @brief Runs @p f (the optimizer, e.g. chunk_adam) once per chunk index with every list of it
   *  resident on the tier the placement chose, releases each gradient after its step, and ends the
   *  iteration. @p f must not open scopes; it may hand its work back still running, by returning
   *  `std::optional<stream_type>` (optimizer_pass.hpp). A step that threw resumes where it failed
   *  when called again. */
  template <class F>
  void step(F&& f) {
    step_with([&f](const step_chunk& c) -> std::optional<stream_type> {
      if constexpr (std::is_void_v<std::invoke_result_t<F&, const step_chunk&>>) {
        f(c);
        return std::nullopt;
      } else {
        return f(c);
      }
    });
  }
  /** @brief step() with the update already in the pass's form; the chunks stepped early (see
   *  arm_early_steps) keep their update, and those still due start (or are carried over) with the
   *  early update; or, with `early_outcome::redo` (the early update's arguments were not this
   *  step's), the ones stepped are undone and every chunk steps with @p update, none carried over. */
  void step_with(update_ref update, early_outcome early = early_outcome::keep);

  /** @brief Steps chunks inside backward, before step(): once a scope has closed after which, by
   *  the trace, nothing in this iteration uses a host-stepped chunk's gradient or parameters again,
   *  the next scope to open (or step(), or for_each_grad_chunk()) first runs `e.update` on that
   *  chunk with its lists on the host (early_step_plan.hpp). step_with() then keeps or redoes those
   *  updates; undo_early_steps() undoes them. A later scope that uses a chunk stepped early (the
   *  iteration left its trace) has it undone first, or gets a `state_error` when `e.undo` is empty.
   *  Under ZeRO (`gradient_mode::sharded`) a rank steps the chunks it owns once their reduction to
   *  it has completed, a group's chunks counting as used together; with replicated gradients, once
   *  gradient_reduced() says the chunk's all-reduce has completed. Returns false and arms nothing
   *  with local gradients over several ranks (a model partitioned outside it). Disarmed by
   *  step_with(), undo_early_steps() and end_iteration().
   *  How chunk_adam uses it: chunk_adam::prepare. */
  bool arm_early_steps(early_steps e);
  /** @brief Says that chunk @p c's gradient holds the sum over the ranks for this iteration (its
   *  all-reduce has completed: replicated_gradients calls it): with `gradient_mode::replicated`, an
   *  early step waits for it. Forgotten at the end of the iteration. */
  void gradient_reduced(std::uint32_t c) {
    if (reduced_.size() < plan_.num_chunks) reduced_.resize(plan_.num_chunks, 0);
    if (c < reduced_.size()) reduced_[c] = 1;
  }
  /** @brief With replicated gradients over several ranks, throws state_error unless every
   *  gradient chunk was reported all-reduced in this iteration (gradient_reduced): a step of local
   *  gradients would make the replicas diverge silently. step() checks it first. */
  void require_replicas_reduced() const;
  /** @brief Chunk indices stepped early in this iteration, in order. */
  [[nodiscard]] std::span<const std::uint32_t> stepped_early() const noexcept { return pass_.stepped_early(); }
  /** @brief Chunk indices whose update the last step carried over to the next forward (below a
   *  disk tier, no room for their lists at the step), not started yet: each starts
   *  as a scope finds room, at the latest when something uses its chunk. */
  [[nodiscard]] std::span<const std::uint32_t> carried_steps() const noexcept { return pass_.carried(); }
  /** @brief Throws state_error naming @p what where chunks stepped early in this iteration await
   *  its step (arming again would forget them: stepped twice, or never undone). */
  void require_no_early_steps_pending(std::string_view what) const {
    if (const auto n = pass_.stepped_early().size(); n > 0)
      throw state_error(std::string(what) + " while " + std::to_string(n) +
                        " chunk(s) stepped early in this iteration await its step: call step(), or abandon the "
                        "iteration first (zero_grad(), then end_iteration(), which undoes them where they were kept)");
  }
  /** @brief Undoes every early step of this iteration (a step skipped on overflow) and disarms.
   *  @throws state_error, changing nothing, where some were taken and nothing kept what undoes them
   *  (early_steps::undo empty: chunk_adam without clipping and with a static loss scale). */
  void undo_early_steps();
  /** @brief True when a step threw part-way: calling step() again finishes it. */
  [[nodiscard]] bool step_in_progress() const noexcept { return pass_.in_progress(); }

  /** @brief Visits every materialised gradient chunk once without moving it (overflow checks,
   *  norms): `f(const step_chunk&)` with `grad`, `where`, `param_type`, `elems`, `tensors`, `slots`,
   *  `specs`. In chunk order, except under ZeRO, where the chunks whose reduction is still in flight
   *  come last, as each lands (what `f` computes per chunk must not depend on the order). */
  void for_each_grad_chunk(function_ref<void(const step_chunk&)> f);
  /** @brief Pins gradient chunk @p c for a collective on its payload: where it is, or on the host (room made
   *  first) when it was on the disk or FREE (then zeros). */
  [[nodiscard]] typename store_type::held_payload hold_gradient(std::uint32_t c);
  /** @brief As hold_gradient(), with the chunk loaded to the compute tier first (evicting as a
   *  scope would): for a communicator that takes device memory (takes_device_memory_v). */
  [[nodiscard]] typename store_type::held_payload hold_gradient_on_device(std::uint32_t c);
  /** @brief Drops every gradient (FREE): the next backward starts from zero (a skipped step, a new accumulation). */
  void zero_grad();
  /** @brief Ends an iteration without a step (after an evaluation pass, a skipped or abandoned
   *  step): HOLD_AFTER_* tensors return to HOLD and the tracer closes the iteration. An iteration
   *  abandoned before its step has its early steps (arm_early_steps) undone where they kept what
   *  undoes them; otherwise they stand (undo_early_steps() says so). */
  void end_iteration();

  /** @brief Starts an untraced section (see untraced_section). */
  [[nodiscard]] untraced_section untraced();

  /** @brief Copies parameter @p p's data in list @p k to @p out as fp32 (any tier; no chunk moves).
   *  A FREE chunk reads as zeros. @throws state_error for a chunk another rank holds (read it on
   *  `owner(p)`, or inside a scope that uses it: gathered there). */
  void read_tensor(param_id p, chunk_kind k, std::span<float> out) const;
  /** @brief Overwrites parameter @p p's data in list @p k from fp32 @p values (narrowed with RNE).
   *  Under ZeRO each rank writes the chunks it owns, between iterations. @throws state_error for a
   *  chunk another rank holds, or a parameter whose group is gathered for this iteration's scopes
   *  (its copies on the ranks would disagree); nothing is written then. */
  void write_tensor(param_id p, chunk_kind k, std::span<const float> values);

  // --- sleep and wake -----------------------------------------------------------------------------
  /** @brief Between steps, frees the device of this runtime's model data: every chunk on the device
   *  moves to the host (spilling to the disk tier, if any, where the host budget is full), copies
   *  in flight finish, and the device space's cached blocks are released (`trim()`, where it has
   *  one), so the model's device memory in use is 0 (`device_chunk_bytes()`; non-model memory the
   *  caller still holds stays: free it first). Until `wake()`, scopes, steps and non-model
   *  allocations are refused (`state_error`); reading and writing tensors works. Values do not
   *  change, so the next step's bits equal those of a run that never slept. Not collective: every
   *  rank sleeps at the same point of its own sequence. @throws state_error with a scope open, a
   *  step part-way, inside an untraced section, between micro-batches of a ZeRO step (sleep after
   *  `step()` or `zero_grad()`), or when asleep. After another throw (a copy that failed) the
   *  chunks already moved stay on the host and the runtime is awake: training may go on. */
  void sleep();
  /** @brief Ends a sleep: the chunks that were on the device start moving back, in order, while
   *  they fit in the budget (the rest load on demand at their scopes). @throws state_error when
   *  not asleep. */
  void wake();
  [[nodiscard]] bool asleep() const noexcept { return asleep_; }

  // --- introspection ------------------------------------------------------------------------------
  [[nodiscard]] const runtime_stats& stats() const noexcept { return stats_; }
  /** @brief Zeroes the counters; peaks restart from the current levels. */
  void reset_stats() noexcept { store_.reset_stats(level_.non_model); }
  [[nodiscard]] const chunk_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] std::span<const tensor_spec> params() const noexcept { return registry_.specs(); }
  [[nodiscard]] const tensor_spec& spec(param_id p) const { return registry_.spec(p); }
  [[nodiscard]] const runtime_options& options() const noexcept { return options_; }
  [[nodiscard]] bool has_list(chunk_kind k) const noexcept { return store_.has(k); }
  [[nodiscard]] TracerT& tracer() noexcept { return tracer_; }
  [[nodiscard]] const TracerT& tracer() const noexcept { return tracer_; }
  [[nodiscard]] Comm& communicator() noexcept { return comm_; }
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  /** @brief Reports scopes, copies, steps and memory levels to @p o (null: nothing) from now on. */
  void set_observer(observer_ref o) noexcept { observer_ = o; }
  /** @brief The timeline recorded when `runtime_options::timeline` is set (empty otherwise). */
  [[nodiscard]] timeline& timeline_recorder() noexcept { return own_timeline_.recorded(); }
  [[nodiscard]] device_space_type& device_space() noexcept { return store_.device(); }
  [[nodiscard]] host_space_type& host_space() noexcept { return store_.host(); }
  /** @brief Whether @p plan (runtime/memory_plan.hpp) fits this runtime: `chunkstar::admit` against
   *  its device space's, its host space's and its disk tier's capacities. */
  [[nodiscard]] admission admit(const memory_plan& plan) {
    return chunkstar::admit(
        plan, {.device = store_.device().capacity(), .host = store_.host().capacity(), .disk = store_.disk_capacity()});
  }
  /** @brief Refuses @p plan before the first step: `config_error` naming each tier's
   *  shortfall in bytes and what to change, unless `admit(plan)` fits. */
  void require_admitted(const memory_plan& plan) {
    const admission a = admit(plan);
    if (!a.fits()) throw config_error("the runtime refuses this run before its first step: " + a.message);
  }
  [[nodiscard]] copy_engine_type& copy_engine() noexcept { return store_.copier(); }
  /** @brief Chunk bytes the compute tier may hold now (placement budget, capped by what non-model data leaves). */
  [[nodiscard]] std::size_t chunk_budget() const;
  [[nodiscard]] std::size_t device_chunk_bytes() const noexcept { return store_.resident(tier::device); }
  [[nodiscard]] std::size_t host_chunk_bytes() const noexcept { return store_.resident(tier::host); }
  [[nodiscard]] std::size_t disk_chunk_bytes() const noexcept { return store_.resident(tier::disk); }
  [[nodiscard]] std::size_t non_model_bytes() const noexcept { return level_.non_model; }
  /** @brief Bytes of model data over all lists, of the whole model: under ZeRO every rank's chunks
   *  together (a rank holds its share, about model_bytes() / N: memory_plan::model_bytes_per_rank,
   *  runtime_stats' peaks); unsharded what must fit in device + host (+ disk with a disk tier). */
  [[nodiscard]] std::size_t model_bytes() const noexcept { return store_.model_bytes(); }
  [[nodiscard]] tier where(chunk_id id) const { return store_.at(id).where; }
  /** @brief The derived state of a chunk (PatrickStar): COMPUTE if any tensor is, else HOLD..., FREE. */
  [[nodiscard]] tensor_state chunk_state(chunk_id id) const {
    return states_.chunk_state(plan_.chunk_tensors.at(id.index),
                               id.kind != chunk_kind::grad || store_.at(id).where != tier::free);
  }
  [[nodiscard]] tensor_state state(param_id p) const { return states_[p.value]; }
  /** @brief Owner rank of chunk index @p c (ZeRO: chunk c belongs to rank c mod N). */
  [[nodiscard]] int owner(std::size_t c) const {
    return store_.at({chunk_kind::param, static_cast<std::uint32_t>(c)}).owner;
  }
  /** @brief Owner rank of parameter @p p's chunk: the rank whose read_tensor / write_tensor of it
   *  works between iterations (every rank's, without sharding). */
  [[nodiscard]] int owner(param_id p) const { return owner(plan_.slots.at(p.value).chunk); }
  [[nodiscard]] gradient_mode gradients() const noexcept {
    return shard_.active() ? gradient_mode::sharded : options_.gradients;
  }
  /** @brief Which chunks this rank owns (ZeRO; one rank owns all without sharding). */
  [[nodiscard]] shard_map shards() const noexcept { return shard_.map(); }
  /** @brief Moves chunk @p id to the host now (a test and tooling hook; from the device or the
   *  disk). @throws state_error if it is in use. */
  void offload(chunk_id id);
  /** @brief Capacity, use, peak and largest free block of every space, plus the runtime's view. */
  [[nodiscard]] memory_report memory_report_now() const;
  /** @brief What is wrong with the runtime's bookkeeping (empty: nothing), for tests after faults;
   *  @p sole_user: only the runtime allocates from the device space (then nothing may leak). */
  [[nodiscard]] std::vector<std::string> invariant_violations(bool sole_user = false) const;

 private:
  friend scope;
  friend untraced_section;
  using residency_type = residency_manager<P, Placement, Eviction, TracerT>;

  chunk_runtime(device_space_type& device, host_space_type& host, copy_engine_type& copier, Comm* comm,
                runtime_options options, Layout layout, Placement placement, Eviction eviction, TracerT tracer);
  static std::optional<Comm> own_if(Comm* c) {
    if constexpr (std::default_initializable<Comm>)
      if (c == nullptr) return std::optional<Comm>(std::in_place);
    return std::nullopt;
  }

  void require_finalized(const char* what) const {
    if (!finalized_)
      throw state_error(std::string(what) + "() before finalize(): register parameters and call finalize() first");
  }
  void require_awake(const char* what) const {
    if (asleep_) throw state_error(std::string(what) + "() while the runtime is asleep: call wake() first");
  }
  void touch(chunk_id id) {
    store_.touch(id);
    if (!level_.untraced) tracer_.record_access(id);
  }
  void sample() const {
    if (observer_)
      observer_.memory(
          {store_.resident(tier::device), store_.resident(tier::host), level_.non_model, store_.resident(tier::disk)});
  }

  /** Runs the early steps the closed scopes made ready (arm_early_steps); one that fails for want
   *  of room stops the early steps (the pass does the rest). @p last: the step's call (see
   *  optimizer_pass::run_early). */
  void run_early_steps(bool last = false);
  scope open_scope(moment_kind kind, std::string_view name, std::vector<param_id> params);
  void scope_closed(moment_kind kind, std::string_view name, double begin_us, std::span<const param_id> params,
                    typename store_type::pin_set& pins) noexcept;
  void order_after_user(std::span<const chunk_id> ids, const stream_type& stream);
  void end_untraced() noexcept;

  template <class T>
  std::span<T> scope_span(param_id p, chunk_kind k, const std::vector<param_id>& in_scope) {
    if (dtype_of_v<std::remove_const_t<T>> != options_.param_type)
      wrong_scope_dtype(p, dtype_of_v<std::remove_const_t<T>>);
    if (std::find(in_scope.begin(), in_scope.end(), p) == in_scope.end()) not_in_scope(p);
    const auto& sl = plan_.slots[p.value];
    return {static_cast<T*>(store_.at({k, static_cast<std::uint32_t>(sl.chunk)}).data) + sl.offset, sl.numel};
  }
  [[noreturn]] void wrong_scope_dtype(param_id p, dtype asked) const;
  [[noreturn]] void not_in_scope(param_id p) const;
  [[noreturn]] void gathered_write(param_id p, chunk_id id) const;

  [[nodiscard]] std::pair<chunk_id, std::size_t> locate(param_id p, chunk_kind k, std::size_t n) const {
    return chunk_values(store_).locate(spec(p), plan_.slots[p.value], k, n);
  }

  runtime_options options_;
  Layout layout_;
  Placement placement_;
  Eviction eviction_;
  TracerT tracer_;
  std::optional<Comm> own_comm_;
  Comm& comm_;
  runtime_stats stats_;
  compute_level level_;
  timeline_observer own_timeline_;
  observer_ref observer_;
  param_registry registry_;
  chunk_plan plan_;
  tensor_state_table states_;
  mutable store_type store_;  // mutable: reading a tensor waits for its copy, which changes no logical state
  residency_type residency_;
  non_model_allocator<device_space_type> non_model_;
  mutable optimizer_pass<store_type, residency_type, TracerT> pass_;  // mutable: a read joins early updates
  mutable shard_manager<store_type, residency_type, TracerT, Comm> shard_;  // mutable: a check waits for gathers
  bool finalized_ = false;
  bool iteration_open_ = false;
  bool asleep_ = false;
  std::size_t closed_through_ = never;  // the last moment of this iteration whose scope has closed
  std::vector<char> reduced_;           // per chunk: its gradient summed over the ranks this iteration (replicated)
  std::vector<chunk_id> slept_;         // the chunks that were on the device when it went to sleep
  open_scope_names open_;
  // The user's work of the scopes closed on a stream, oldest first: at most
  // runtime_options::scopes_ahead of them unfinished once the next scope has opened.
  std::deque<typename store_type::copy_handle> scopes_running_;
};

// --- definitions ---------------------------------------------------------------------------------
#define CHUNKSTAR_RUNTIME_TEMPLATE                                                                    \
  template <ChunkLayout Layout, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT, \
            Communicator Comm, Platform P>
#define CHUNKSTAR_RUNTIME chunk_runtime<Layout, Placement, Eviction, TracerT, Comm, P>

CHUNKSTAR_RUNTIME_TEMPLATE
CHUNKSTAR_RUNTIME::chunk_runtime(device_space_type& device, host_space_type& host, copy_engine_type& copier, Comm* comm,
                                 runtime_options options, Layout layout, Placement placement, Eviction eviction,
                                 TracerT tracer)
    : options_(options),
      layout_(std::move(layout)),
      placement_(std::move(placement)),
      eviction_(std::move(eviction)),
      tracer_(std::move(tracer)),
      own_comm_(own_if(comm)),
      comm_(comm ? *comm : *own_comm_),
      store_(device, host, copier, options.payload_alignment, stats_),
      residency_(store_, placement_, eviction_, tracer_, level_, options.prefetch_depth, stats_,
                 options.disk_prefetch_depth, options.disk_prefetch_horizon, options.disk_staging_chunks),
      non_model_(device, level_),
      pass_(store_, residency_, tracer_, level_, stats_, options.prefetch_depth, options.background_updates),
      shard_(store_, residency_, tracer_, comm_, options.sharding, stats_, level_) {
  if (options_.sharding.micro_batches < 1)
    throw config_error(
        "runtime_options::sharding.micro_batches must be >= 1 (the backward passes per optimizer step), got " +
        std::to_string(options_.sharding.micro_batches));
  if (options_.sharding.gather_depth < 1)
    throw config_error(
        "runtime_options::sharding.gather_depth must be >= 1 (how many scopes ahead a ZeRO gather may start; "
        "gather_ahead = false turns gathers ahead off), got " +
        std::to_string(options_.sharding.gather_depth));
  if (options_.timeline) observer_ = own_timeline_;
  store_.clock = [this] { return observer_.now_us(); };
  store_.on_copy_retired = [this](double submitted, tier from, tier to) {
    observer_.copy(from, to, submitted, observer_.now_us());
  };
  // A chunk this rank sends to the others (ZeRO's gathers) waits for its early update first.
  shard_.before_send = [this](chunk_id id) {
    const chunk_id ids[] = {id};
    pass_.join_early(ids);
  };
  // The next iteration's first groups travel while the step goes on (ZeRO; gather_plan::step).
  pass_.on_stepped = [this](std::uint32_t c) { shard_.stepped(c); };
  // A host full of chunks pinned by early updates (below a disk tier) gets its room once they finish.
  residency_.release_host_pins = [this] {
    if (!pass_.early_running()) return false;
    pass_.join_quietly();  // inside a move: a failure surfaces at the runtime's next call
    return true;
  };
  pass_.on_early_update = [this](std::chrono::steady_clock::time_point b, std::chrono::steady_clock::time_point e) {
    if (!observer_) return;
    const double now = observer_.now_us();
    const auto t = std::chrono::steady_clock::now();
    const auto us_ago = [&](std::chrono::steady_clock::time_point x) {
      return std::chrono::duration<double, std::micro>(t - x).count();
    };
    observer_.step(now - us_ago(b), now - us_ago(e));
  };
}

CHUNKSTAR_RUNTIME_TEMPLATE
CHUNKSTAR_RUNTIME::~chunk_runtime() {
  observer_ = {};  // the store's last copies retire after a user's observer may be gone
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::attach_disk(disk_tier disk) {
  if (finalized_) throw state_error("attach_disk() after finalize(): attach the disk tier before finalize()");
  if (store_.has_disk()) throw state_error("attach_disk() called twice: a runtime has one disk tier");
  ::chunkstar::attach_disk(store_, disk);
}

CHUNKSTAR_RUNTIME_TEMPLATE
param_id CHUNKSTAR_RUNTIME::register_param(tensor_spec spec, param_initializer init) {
  if (finalized_)
    throw state_error("register_param('" + spec.name + "') after finalize(): register every parameter first");
  return registry_.add(std::move(spec), std::move(init), options_.param_type);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::finalize(std::span<const config_field> run) {
  if (finalized_) throw state_error("finalize() called twice");
  finalized_ = true;
  plan_ = registry_.plan(layout_);
  auto fields = describe_configuration(registry_.specs(), plan_, layout_.name(), options_);
  fields.insert(fields.begin(), run.begin(),
                run.end());  // the run's fields first: a trainer's option is the likelier cause
  require_agreement(comm_, fields, "finalize()");
  plan_.num_chunks = shard_.map().padded(plan_.num_chunks);  // ZeRO: whole groups (the padding holds no tensor)
  plan_.chunk_tensors.resize(plan_.num_chunks);
  store_.build(
      make_chunk_lists(plan_, {.param_type = options_.param_type, .optimizer_state = options_.optimizer_state}),
      comm_.size());
  states_.reset(registry_.specs());
  store_.allocate_initial(shard_.active(), comm_.rank());
  std::vector<float> values;
  for (std::size_t t = 0; t < registry_.size(); ++t) {
    if (!shard_.map().owns(plan_.slots[t].chunk)) continue;  // flyweight: only this rank's shards
    values.assign(registry_.specs()[t].numel(), 0.0f);
    if (registry_.initializer(t)) registry_.initializer(t)(values);
    write_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, values);
    if (store_.has(chunk_kind::master))
      write_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::master, values);
  }
  registry_.clear_initializers();
}

CHUNKSTAR_RUNTIME_TEMPLATE
void* CHUNKSTAR_RUNTIME::allocate_non_model(std::size_t bytes, std::size_t alignment) {
  require_awake("allocate_non_model");
  void* p = non_model_.allocate(
      bytes, alignment, [&] { return residency_.free_one_for_non_model(); }, [&] { return memory_report_now(); },
      open_.innermost());
  stats_.peak_non_model_bytes = std::max(stats_.peak_non_model_bytes, level_.non_model);
  store_.note_device_peak();
  if (!level_.untraced) {
    tracer_.record_non_model(level_.non_model);
    ++level_.changes;
  }
  sample();
  return p;
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::deallocate_non_model(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  non_model_.deallocate(p, bytes, alignment);
  if (level_.untraced) return;
  try {
    tracer_.record_non_model(level_.non_model);
    ++level_.changes;
    if (level_.releasing == never && iteration_open_)
      residency_.prefetch(tracer_.current_moment());  // a step prefetches for itself
  } catch (...) {  // an optimisation only: what cannot start now loads on demand at its scope
  }
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::step_with(update_ref update, early_outcome early) {
  require_finalized("step");
  require_awake("step");
  states_.require_none_in_compute("step");
  if (level_.untraced) throw state_error("step() inside an untraced section: close the section first");
  require_replicas_reduced();
  shard_.finish_backward();
  if (early == early_outcome::keep) run_early_steps(true);  // those the last scopes made ready
  const double t0 = observer_.now_us();
  pass_.run(update, plan_, registry_.specs(), options_.param_type, shard_.map(), early);
  shard_.step_done();
  observer_.step(t0, observer_.now_us());
  ++stats_.steps;
  zero_grad();
  end_iteration();
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::require_replicas_reduced() const {
  if (gradients() != gradient_mode::replicated || comm_.size() <= 1) return;
  for (std::uint32_t c = 0; c < plan_.num_chunks; ++c)
    if (holds_payload(store_.at({chunk_kind::grad, c}).where) && (c >= reduced_.size() || reduced_[c] == 0))
      throw state_error("step() over replicated gradients (gradient_mode::replicated) on " +
                        std::to_string(comm_.size()) + " ranks, but chunk " + std::to_string(c) +
                        "'s gradient was not all-reduced in this iteration: each rank would step its own "
                        "gradients and the replicas diverge. Use replicated_gradients (after_backward() after "
                        "each backward scope, synchronize() before the step), or report your own all-reduce of "
                        "each chunk with gradient_reduced(c)");
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::for_each_grad_chunk(function_ref<void(const step_chunk&)> f) {
  // Under ZeRO the last reductions are still in flight here: the chunks already final are visited
  // while they travel, then each reduction's as it lands (a norm's scan hides behind the link).
  require_replicas_reduced();  // before a norm of local gradients is taken for the global one
  shard_.close_backward();
  std::vector<char> seen(plan_.num_chunks, 0);
  do {
    if (open_.size() == 0) run_early_steps();  // the early updates only read their gradients: they go on
    for_each_gradient(store_, plan_, registry_.specs(), options_.param_type, f, [&](std::uint32_t c) {
      if (seen[c] || shard_.reducing(c)) return false;
      return seen[c] = 1, true;
    });
  } while (shard_.finish_one_reduction());
}

CHUNKSTAR_RUNTIME_TEMPLATE
bool CHUNKSTAR_RUNTIME::arm_early_steps(early_steps e) {
  require_finalized("arm_early_steps");
  // Local gradients over several ranks: a model partitioned outside it (RTP), whose shards step
  // after their rotation. Replicated ones wait for gradient_reduced() (replicated_gradients).
  if ((gradients() == gradient_mode::local && comm_.size() > 1) || !e.update) return false;
  if (pass_.in_progress())
    throw state_error("arm_early_steps() while a step that threw is unfinished: call step() again first");
  require_no_early_steps_pending("arm_early_steps");
  pass_.arm(std::move(e), shard_.map(), shard_.used_together());
  return true;
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::undo_early_steps() {
  states_.require_none_in_compute("undo_early_steps");
  pass_.undo_all_early(plan_, registry_.specs(), options_.param_type);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::run_early_steps(bool last) {
  if (!pass_.armed() || !iteration_open_) return;
  try {
    pass_.run_early(
        closed_through_, plan_, registry_.specs(), options_.param_type,
        [&](std::uint32_t c) {
          if (gradients() == gradient_mode::replicated) return c < reduced_.size() && reduced_[c] != 0;
          return shard_.gradient_in_place(c);
        },
        last);
  } catch (const state_error&) {
    throw;
  } catch (const std::exception&) {  // an optimisation: no room for a chunk's lists now, say
    pass_.stop_early();              // the rest step in the pass; those stepped stay stepped
  }
}

CHUNKSTAR_RUNTIME_TEMPLATE
typename CHUNKSTAR_RUNTIME::store_type::held_payload CHUNKSTAR_RUNTIME::hold_gradient(std::uint32_t c) {
  const chunk_id mine[] = {{chunk_kind::grad, c}};
  pass_.join_early(mine);  // an early update still running on its chunk (the others go on)
  require_awake("hold_gradient");
  const chunk_id id{chunk_kind::grad, c};
  const tier where = store_.at(id).where;
  // A payload that comes to the host (from the disk, or a zeroed FREE one) needs room there first:
  // with a disk tier the host is full, and room means sending down what is needed latest.
  if (where == tier::disk || where == tier::free) residency_.make_resident_on_host(id);
  return store_.hold(id);
}

CHUNKSTAR_RUNTIME_TEMPLATE
typename CHUNKSTAR_RUNTIME::store_type::held_payload CHUNKSTAR_RUNTIME::hold_gradient_on_device(std::uint32_t c) {
  const chunk_id mine[] = {{chunk_kind::grad, c}};
  pass_.join_early(mine);  // an early update still running on its chunk (the others go on)
  require_awake("hold_gradient_on_device");
  const chunk_id ids[] = {{chunk_kind::grad, c}};
  residency_.make_resident_on_device(ids, "gradient all-reduce", tracer_.current_moment());
  return store_.hold(ids[0]);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::zero_grad() {
  states_.require_none_in_compute("zero_grad");
  shard_.drop(/*keep_next=*/true);  // the step's gathers for the next iteration are parameters
  for (std::uint32_t c = 0; c < plan_.num_chunks; ++c) pass_.release_gradient(c);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::end_iteration() {
  states_.require_none_in_compute("end_iteration");
  if (level_.untraced) throw state_error("end_iteration() inside an untraced section: close the section first");
  // An iteration abandoned before its step (an exception in the user's forward or backward): what
  // its early updates changed goes back where they kept what undoes it; without that, they stand.
  if (!pass_.in_progress() && pass_.can_undo_early())
    pass_.undo_all_early(plan_, registry_.specs(), options_.param_type);
  pass_.disarm();
  states_.end_iteration();
  shard_.drop(/*keep_next=*/true);  // those gathered by a step (its chunks' values as they are now)
  reduced_.assign(reduced_.size(), 0);
  if (iteration_open_) tracer_.end_iteration();
  iteration_open_ = false;
  pass_.abandon();  // an unfinished step is abandoned
}

CHUNKSTAR_RUNTIME_TEMPLATE
typename CHUNKSTAR_RUNTIME::untraced_section CHUNKSTAR_RUNTIME::untraced() {
  require_finalized("untraced");
  states_.require_none_in_compute("untraced");
  if (std::exchange(level_.untraced, true))
    throw state_error("untraced() while an untraced section is already open: close it first");
  return untraced_section(this);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::read_tensor(param_id p, chunk_kind k, std::span<float> out) const {
  pass_.join_early();  // an early update still running on its chunk
  const auto [id, offset] = locate(p, k, out.size());
  chunk_values(store_).read(id, offset, out);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::write_tensor(param_id p, chunk_kind k, std::span<const float> values) {
  pass_.join_early();  // an early update still running on its chunk
  const auto [id, offset] = locate(p, k, values.size());
  if (k == chunk_kind::param) {
    if (shard_.gathered_for_use(id.index)) gathered_write(p, id);
    shard_.params_written();  // copies the step sent ahead are stale now
  }
  chunk_values(store_).write(id, offset, values);
}

CHUNKSTAR_RUNTIME_TEMPLATE
std::size_t CHUNKSTAR_RUNTIME::chunk_budget() const { return residency_.budget_now(); }

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::offload(chunk_id id) {
  pass_.join_early();       // an early update still running on its chunk
  shard_.settle_gathers();  // a chunk sent to the other ranks (the step's gathers ahead) is pinned till then
  require_awake("offload");
  if (store_.at(id).pinned || chunk_state(id) == tensor_state::compute)
    throw state_error("cannot move chunk " + to_string(id) + ": a tensor in it is in COMPUTE; close its scope first");
  residency_.make_resident_on_host(id);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::sleep() {
  require_finalized("sleep");
  require_awake("sleep");
  if (open_.size() > 0)
    throw state_error("sleep() with scope '" + std::string(open_.innermost()) + "' open: close every scope first");
  if (level_.untraced) throw state_error("sleep() inside an untraced section: close the section first");
  if (pass_.in_progress())
    throw state_error("sleep() during a step that threw part-way: call step() again to finish it, or end_iteration()");
  if (shard_.gradients_open())
    throw state_error(
        "sleep() between micro-batches of a ZeRO step (gradient groups are open): sleep after step() or zero_grad()");
  if (!pass_.stepped_early().empty())
    throw state_error("sleep() with chunks stepped early and the step not taken: sleep after step()");
  pass_.join_early();             // the last step's early updates: their chunks move now
  shard_.drop();                  // gathered copies of other ranks' chunks (an evaluation's): gathered again on use
  store_.copier().synchronize();  // the prefetches a step started have landed
  store_.retire_completed();
  std::vector<chunk_id> on_device;
  for (auto k : all_chunk_kinds)
    if (store_.has(k))
      for (std::uint32_t c = 0; c < plan_.num_chunks; ++c)
        if (store_.at({k, c}).where == tier::device) on_device.push_back({k, c});
  for (auto id : on_device) residency_.make_resident_on_host(id);
  while (store_.retire_one(tier::device)) {
  }
  if constexpr (requires(device_space_type & d) { d.trim(); }) store_.device().trim();
  slept_ = std::move(on_device);
  asleep_ = true;
  sample();
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::wake() {
  if (!asleep_) throw state_error("wake() while awake: call sleep() first");
  asleep_ = false;
  const std::vector<chunk_id> back = std::exchange(slept_, {});
  residency_.bring_back(back);
  sample();
}

CHUNKSTAR_RUNTIME_TEMPLATE
memory_report CHUNKSTAR_RUNTIME::memory_report_now() const { return residency_.report(); }

CHUNKSTAR_RUNTIME_TEMPLATE
std::vector<std::string> CHUNKSTAR_RUNTIME::invariant_violations(bool sole_user) const {
  pass_.join_quietly();  // an update still running pins its chunk (a failure surfaces at the next call)
  shard_.settle_gathers_quietly();  // so does a chunk the step sends to the other ranks
  auto v = store_.violations(open_.size() > 0 || pass_.in_progress(), level_.non_model, sole_user);
  if (open_.size() == 0 && states_.any_in_compute()) v.push_back("a tensor is in COMPUTE with no scope open");
  return v;
}

CHUNKSTAR_RUNTIME_TEMPLATE
typename CHUNKSTAR_RUNTIME::scope CHUNKSTAR_RUNTIME::open_scope(moment_kind kind, std::string_view name,
                                                                std::vector<param_id> params) {
  require_finalized(kind == moment_kind::forward ? "forward" : "backward");
  require_awake(kind == moment_kind::forward ? "forward" : "backward");
  std::vector<chunk_id> ids = scope_chunks(plan_, params, kind, name);
  // The host runs at most scopes_ahead scopes ahead of the user's work: what it decides (moves,
  // early updates, room) stays near what the device is doing, and so do the buffers it takes. A
  // failed piece of that work throws here, once, before anything of this scope has happened.
  while (!scopes_running_.empty() &&
         (scopes_running_.size() > options_.scopes_ahead || scopes_running_.front().ready())) {
    const auto oldest = scopes_running_.front();
    scopes_running_.pop_front();
    oldest.wait();
  }
  if (!iteration_open_ && !level_.untraced) {
    tracer_.begin_iteration();
    iteration_open_ = true;
    closed_through_ = never;
  }
  shard_.settle();
  pass_.reap_early();  // early updates done: their chunks may move again, and their room is free
  if (pass_.armed() && !level_.untraced && open_.size() == 0) run_early_steps();
  pass_.join_early(ids);  // early updates still running on this scope's chunks (the last step's, say)
  // Those that ended meanwhile: their weights start up while this scope computes; and the next
  // update the step carried over starts now, while this scope computes, rather than when the
  // scope that reads its chunk opens (room made for it as that scope would make it).
  pass_.reap_early(/*ahead=*/true);
  if (pass_.armed()) {    // a chunk stepped early that this scope uses: the iteration left its trace
    const std::size_t n = shard_.used_together();  // ZeRO gathers (sends) a group's chunks as one
    for (auto id : ids)
      for (std::size_t c = id.index / n * n; c < std::min<std::size_t>(plan_.num_chunks, id.index / n * n + n); ++c)
        pass_.undo_early(static_cast<std::uint32_t>(c), plan_, registry_.specs(), options_.param_type);
  }
  const double t0 = observer_.now_us();
  const std::size_t m = level_.untraced ? never : tracer_.open_moment(kind, name);
  level_.changes = 0;
  level_.kind = kind;
  store_.retire_completed();
  for (auto id : ids) touch(id);
  const auto owned = shard_.prepare(ids, kind, name, m);
  pass_.with_room([&] { residency_.make_resident_on_device(owned, name, m); });
  typename store_type::pin_set pins(store_, std::move(ids));
  shard_.gather_ahead(m, name);  // the next moments' groups arrive while this one computes
  for (auto p : params) states_.open(p.value);
  ++stats_.scopes;
  open_.push(name);
  sample();
  residency_.prefetch(m);
  const double t1 = observer_.now_us();
  observer_.scope_open(kind, name, t0, t1);
  return scope(this, kind, name, t1, std::move(params), std::move(pins));
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::scope_closed(moment_kind kind, std::string_view name, double begin_us,
                                     std::span<const param_id> params, typename store_type::pin_set& pins) noexcept {
  pins.reset();
  for (auto p : params) {
    try {
      states_.close(p.value, kind);
    } catch (...) {  // cannot happen for a scope the runtime opened; never throw from a destructor
    }
  }
  observer_.scope_close(kind, name, begin_us, observer_.now_us());
  open_.pop(name);
  if (!level_.untraced) closed_through_ = tracer_.current_moment();
  shard_.closed(tracer_.current_moment());
  try {  // its chunks may leave now: the coming moments' transfers can start (an optimisation)
    if (!level_.untraced && level_.releasing == never) residency_.prefetch(tracer_.current_moment());
  } catch (...) {
  }
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::order_after_user(std::span<const chunk_id> ids, const stream_type& stream) {
  const auto done = store_.copier().record(stream);
  for (auto id : ids) store_.order_after_user(id, done);
  if (options_.scopes_ahead != unbounded_scopes_ahead) scopes_running_.push_back(done);
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::end_untraced() noexcept {
  level_.untraced = false;
  try {
    states_.end_iteration();
  } catch (...) {  // a scope outlived the section (documented misuse): its tensors stay as they are
  }
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::wrong_scope_dtype(param_id p, dtype asked) const {
  throw config_error("parameter '" + spec(p).name + "' is " + std::string(dtype_name(options_.param_type)) + ", not " +
                     std::string(dtype_name(asked)) + ": ask for its dtype");
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::gathered_write(param_id p, chunk_id id) const {
  const int owner = shard_.map().owner(id.index);
  throw state_error(
      "cannot write parameter '" + spec(p).name + "' (" + to_string(id) + ") now: its ZeRO group is gathered for " +
      "this iteration's scopes, so " +
      (owner == comm_.rank()
           ? std::string("the other ranks' copies would keep the old values")
           : "this rank holds only a copy of rank " + std::to_string(owner) + "'s chunk, and the write would be lost") +
      "; write parameters between iterations (after step(), zero_grad() or end_iteration()), each on the rank that "
      "owns them");
}

CHUNKSTAR_RUNTIME_TEMPLATE
void CHUNKSTAR_RUNTIME::not_in_scope(param_id p) const {
  throw state_error("parameter '" + spec(p).name + "' is not part of this scope: list it when opening the scope");
}

#undef CHUNKSTAR_RUNTIME
#undef CHUNKSTAR_RUNTIME_TEMPLATE

}  // namespace chunkstar
