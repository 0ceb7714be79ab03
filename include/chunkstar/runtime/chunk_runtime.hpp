/** @file
 *  @brief `chunk_runtime`: PatrickStar's runtime, composed from policies at compile time.
 *
 *  A user registers parameters, finalises the layout, and wraps each layer's forward and backward in
 *  an access scope. The runtime keeps every chunk in exactly one tier (move semantics, so the model
 *  data may exceed either tier alone), makes a scope's chunks resident on the compute tier, evicts
 *  what the eviction strategy picks when the placement policy's budget is reached, prefetches the
 *  next chunks of the trace on the copy engine, and runs each chunk's optimizer step where the
 *  placement put it. See docs/design.md for the state model and a worked example.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/eviction_strategy.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/placement_policy.hpp>
#include <chunkstar/runtime/chunk_id.hpp>
#include <chunkstar/runtime/runtime_stats.hpp>
#include <chunkstar/runtime/timeline.hpp>
#include <chunkstar/tracer/tracer.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief The memory back-end a runtime runs on: its compute (device) space, host space and the
 *  copy engine between them. `simulated_platform` runs anywhere; `cuda::cuda_platform` on GPUs. */
template <MemorySpace Device, MemorySpace Host, CopyEngine Copier>
struct platform {
  using device_space = Device;
  using host_space = Host;
  using copy_engine = Copier;
};

/** @brief CPU-only platform: a simulated device with a hard capacity and an optional modelled link. */
using simulated_platform = platform<simulated_device_space, host_space, host_copy_engine>;

/** @brief Numeric knobs of a runtime (values, not types). */
struct runtime_options {
  dtype param_type = dtype::f32;     ///< compute precision of params and grads
  bool optimizer_state = true;       ///< allocate master (for 16-bit params), momentum and variance lists
  std::size_t prefetch_depth = 2;    ///< most loads in flight ahead of the next moment; 0 turns prefetch off
  std::size_t payload_alignment = 4096;  ///< alignment of chunk payloads (copies and SIMD like it)
  bool timeline = false;             ///< record a Chrome-trace timeline (see `timeline()`)
};

/** @brief Handle of a registered parameter. */
struct param_id {
  std::uint32_t value = 0;
  friend constexpr bool operator==(const param_id& a, const param_id& b) noexcept { return a.value == b.value; }
};

/** @brief Fills a parameter's initial values (fp32; the runtime narrows them to the param dtype). */
using param_initializer = std::function<void(std::span<float>)>;

/** @brief One chunk index's data as handed to an optimizer step: every list's payload on `where`.
 *  Pointers are null for lists that do not exist (no master for fp32 params: the param is it). */
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

/** @brief The chunk runtime.
 *  @tparam Layout        ChunkLayout: maps parameters to chunks.
 *  @tparam Placement     PlacementPolicy: chunk budget per moment, optimizer tier per chunk.
 *  @tparam Eviction      EvictionStrategy: picks victims.
 *  @tparam TracerT       Tracer: records moments and accesses, answers next-use questions.
 *  @tparam Comm          Communicator: ranks (chunk owners) and collectives.
 *  @tparam Platform      the spaces and copy engine (`platform<...>`).
 */
template <ChunkLayout Layout = searched_chunk_layout, PlacementPolicy Placement = auto_placement,
          EvictionStrategy Eviction = belady_eviction, Tracer TracerT = warmup_tracer,
          Communicator Comm = single_process_communicator, class Platform = simulated_platform>
class chunk_runtime {
 public:
  using device_space_type = typename Platform::device_space;
  using host_space_type = typename Platform::host_space;
  using copy_engine_type = typename Platform::copy_engine;
  using layout_type = Layout;
  using placement_type = Placement;
  using eviction_type = Eviction;
  using tracer_type = TracerT;
  using communicator_type = Comm;

  class scope;

  chunk_runtime(device_space_type& device, host_space_type& host, copy_engine_type& copier, runtime_options options = {},
                Layout layout = {}, Placement placement = {}, Eviction eviction = {}, TracerT tracer = {},
                Comm comm = {})
      : device_(device),
        host_(host),
        copier_(copier),
        options_(options),
        layout_(std::move(layout)),
        placement_(std::move(placement)),
        eviction_(std::move(eviction)),
        tracer_(std::move(tracer)),
        comm_(std::move(comm)) {
    timeline_.enable(options_.timeline);
  }

  chunk_runtime(const chunk_runtime&) = delete;
  chunk_runtime& operator=(const chunk_runtime&) = delete;

  ~chunk_runtime() {
    copier_.synchronize();
    for (auto& r : retiring_) release_buffer(r);
    for (auto& list : lists_)
      for (auto& s : list.chunks) free_payload(s, list.desc.chunk_bytes);
  }

  // ---------------------------------------------------------------------------------------------
  // Registration

  /** @brief Registers a parameter; @p init fills its fp32 initial values (zeros when empty).
   *  @throws state_error after finalize(); config_error for a duplicate name or a dtype that is not
   *  the runtime's param_type. */
  param_id register_param(tensor_spec spec, param_initializer init = {}) {
    if (finalized_) throw state_error("register_param('" + spec.name + "') after finalize(): register every parameter first");
    if (spec.type != options_.param_type)
      throw config_error("parameter '" + spec.name + "' is " + std::string(dtype_name(spec.type)) +
                         " but the runtime's param_type is " + std::string(dtype_name(options_.param_type)) +
                         ": register it with that dtype or change runtime_options::param_type");
    if (!names_.emplace(spec.name, specs_.size()).second)
      throw config_error("parameter '" + spec.name + "' registered twice: parameter names must be unique (tie parameters by reusing the param_id)");
    specs_.push_back(std::move(spec));
    inits_.push_back(std::move(init));
    return {static_cast<std::uint32_t>(specs_.size() - 1)};
  }

  /** @brief Lays out the parameters, allocates the chunk lists (on the host, spilling to the compute
   *  tier when the host is full) and initialises parameters and optimizer state. */
  void finalize() {
    if (finalized_) throw state_error("finalize() called twice");
    plan_ = layout_.plan(specs_);
    chunk_list_options lo{.param_type = options_.param_type, .grads = grad_storage::separate,
                          .optimizer_state = options_.optimizer_state};
    for (const auto& d : make_chunk_lists(plan_, lo)) {
      auto& l = lists_[static_cast<std::size_t>(d.kind)];
      l.present = true;
      l.desc = d;
      l.chunks.resize(d.num_chunks);
      for (std::size_t c = 0; c < d.num_chunks; ++c) l.chunks[c].owner = static_cast<int>(c % comm_.size());
    }
    states_.assign(specs_.size(), tensor_state::hold);
    refs_.assign(specs_.size(), 0);
    for (auto k : {chunk_kind::param, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance}) {
      if (!has(k)) continue;
      for (std::uint32_t c = 0; c < plan_.num_chunks; ++c) {
        auto& s = slot({k, c});
        s.data = allocate_payload(bytes_of(k), tier::host, /*may_spill=*/true, s.where);
        if (s.where == tier::host) std::memset(s.data, 0, bytes_of(k));
        else zero_device(s.data, bytes_of(k));
        count_resident(s.where, bytes_of(k), +1);
      }
    }
    std::vector<float> values;
    for (std::size_t t = 0; t < specs_.size(); ++t) {
      values.assign(specs_[t].numel(), 0.0f);
      if (inits_[t]) inits_[t](values);
      write_tensor_values(t, chunk_kind::param, values);
      if (has(chunk_kind::master)) write_tensor_values(t, chunk_kind::master, values);
    }
    inits_.clear();
    finalized_ = true;
  }

  // ---------------------------------------------------------------------------------------------
  // Access scopes

  /** @brief An open access scope: the chunks of its parameters are resident on the compute tier
   *  and their tensors are in COMPUTE until it closes. Move-only; closes on destruction. */
  class scope {
   public:
    scope(scope&& o) noexcept : rt_(std::exchange(o.rt_, nullptr)), kind_(o.kind_), params_(std::move(o.params_)) {}
    scope& operator=(scope&&) = delete;
    ~scope() {
      if (rt_) rt_->close_scope(kind_, params_);
    }

    /** @brief The parameter's values on the compute tier. @p T must be the runtime's param dtype. */
    template <class T>
    [[nodiscard]] std::span<T> param(param_id p) const {
      return rt_->template tensor_span<T>(p, chunk_kind::param, params_);
    }
    /** @brief The parameter's gradient (backward scopes only); kernels accumulate (+=) into it. */
    template <class T>
    [[nodiscard]] std::span<T> grad(param_id p) const {
      if (kind_ != moment_kind::backward)
        throw state_error("grad('" + rt_->specs_[p.value].name + "') in a forward scope: gradients exist in backward scopes");
      return rt_->template tensor_span<T>(p, chunk_kind::grad, params_);
    }
    /** @brief Closes the scope now (also done by the destructor). */
    void close() {
      if (rt_) std::exchange(rt_, nullptr)->close_scope(kind_, params_);
    }

   private:
    friend class chunk_runtime;
    scope(chunk_runtime* rt, moment_kind k, std::vector<param_id> p) : rt_(rt), kind_(k), params_(std::move(p)) {}
    chunk_runtime* rt_;
    moment_kind kind_;
    std::vector<param_id> params_;
  };

  /** @brief Opens a forward scope named @p name over @p params (a moment of the trace). */
  [[nodiscard]] scope forward(std::string_view name, std::vector<param_id> params) {
    open_scope(moment_kind::forward, name, params);
    return scope(this, moment_kind::forward, std::move(params));
  }
  /** @brief Opens a backward scope: params and (zero-initialised on first use) grads resident. */
  [[nodiscard]] scope backward(std::string_view name, std::vector<param_id> params) {
    open_scope(moment_kind::backward, name, params);
    return scope(this, moment_kind::backward, std::move(params));
  }

  // ---------------------------------------------------------------------------------------------
  // Non-model memory on the compute tier

  /** @brief Allocates activation / workspace memory on the compute tier, evicting chunks not in use
   *  if needed; the runtime's accounting (and the tracer) see it as non-model data. */
  void* allocate_non_model(std::size_t bytes, std::size_t alignment = 64) {
    void* p = device_.try_allocate(bytes, alignment);
    while (p == nullptr) {
      if (!retire_one_pending(tier::device) && !evict_one({}, never)) {
        throw out_of_memory_error("cannot allocate " + format_bytes(bytes) +
                                      " of non-model memory on the compute tier: every chunk there is in use. "
                                      "Raise the device budget, shrink the micro-batch, or use smaller chunks",
                                  bytes, memory_report_now());
      }
      p = device_.try_allocate(bytes, alignment);
    }
    non_model_ += bytes;
    stats_.peak_non_model_bytes = std::max(stats_.peak_non_model_bytes, non_model_);
    if (!untraced_) {
      tracer_.record_non_model(non_model_);
      ++non_model_changes_;
    }
    sample_counters();
    return p;
  }
  /** @brief Frees memory from allocate_non_model. The budget of the rest of the moment may rise
   *  (the trace knows what the moment still allocates), so the next chunks start loading now. */
  void deallocate_non_model(void* p, std::size_t bytes, std::size_t alignment = 64) noexcept {
    device_.deallocate(p, bytes, alignment);
    non_model_ -= bytes;
    if (untraced_) return;
    tracer_.record_non_model(non_model_);
    ++non_model_changes_;
    if (step_chunk_ != never || !iteration_open_) return;  // the step prefetches for itself
    try {
      prefetch(tracer_.current_moment());
    } catch (...) {  // an optimisation only: what cannot start now loads on demand at its scope
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Optimizer step and iteration boundaries

  /** @brief Runs @p f once per chunk index, with every list of that chunk resident on the tier the
   *  placement chose (`step_chunk::where`), then releases the gradients and ends the iteration.
   *  @p f is the optimizer (for example `chunk_adam`); it must not open scopes. */
  template <class F>
  void step(F&& f) {
    require_finalized("step");
    require_no_compute("step");
    if (untraced_) throw state_error("step() inside an untraced section: close the section first");
    const auto t0 = timeline_.now_us();
    for (std::uint32_t c = 0; c < plan_.num_chunks; ++c) {
      // One moment per chunk index, so the trace orders the step's chunks like any scope's: Belady
      // sees which state is needed next and the prefetcher loads the next chunks while this steps.
      const std::size_t m = tracer_.open_moment(moment_kind::optimizer, "optimizer");
      non_model_changes_ = 0;
      step_chunk_ = c;
      retire_completed();
      const tier where = placement_.optimizer_tier(inputs(), c);
      std::vector<chunk_id> ids;
      for (auto k : {chunk_kind::param, chunk_kind::grad, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance})
        if (has(k)) ids.push_back({k, c});
      if (where == tier::device) {
        for (auto id : ids) touch(id);
        make_resident_on_device(ids, "optimizer", m);
      } else {
        for (auto id : ids) make_resident_on_host(id);
      }
      for (auto id : ids) ++slot(id).pinned;
      // The trace holds device accesses only, so it cannot know that a later chunk of this step
      // needs its lists on the host first: never fetch those up just to move them down again.
      prefetch(m, [&](chunk_id id) { return id.index > c && placement_.optimizer_tier(inputs(), id.index) == tier::host; });
      if (options_.prefetch_depth) offload_ahead(c);
      step_chunk view{.index = c, .where = where, .param_type = options_.param_type, .elems = plan_.chunk_elems,
                      .param = slot({chunk_kind::param, c}).data, .grad = slot({chunk_kind::grad, c}).data,
                      .master = has(chunk_kind::master) ? static_cast<float*>(slot({chunk_kind::master, c}).data) : nullptr,
                      .momentum = has(chunk_kind::momentum) ? static_cast<float*>(slot({chunk_kind::momentum, c}).data) : nullptr,
                      .variance = has(chunk_kind::variance) ? static_cast<float*>(slot({chunk_kind::variance, c}).data) : nullptr,
                      .tensors = plan_.chunk_tensors[c], .slots = plan_.slots, .specs = specs_};
      try {
        f(view);
      } catch (...) {
        for (auto id : ids) --slot(id).pinned;
        step_chunk_ = never;
        throw;
      }
      for (auto id : ids) --slot(id).pinned;
      ++(where == tier::device ? stats_.device_steps : stats_.host_steps);
      // The gradient is spent: free it now rather than after the loop, so a host-side step never
      // needs every chunk's gradient on the host at once. A param stepped on the host goes back to
      // the compute tier while there is budget, which is where forward wants it.
      release_grad(c);
      if (where == tier::host && resident_[0] + bytes_of(chunk_kind::param) <= budget_now())
        start_move({chunk_kind::param, c}, tier::device, move_reason::load);
    }
    step_chunk_ = never;
    timeline_.span(timeline::track::optimizer, "optimizer step", t0, timeline_.now_us());
    ++stats_.steps;
    zero_grad();
    end_iteration();
  }

  /** @brief Visits every materialised gradient chunk in order without moving it (for overflow
   *  checks and norms): `f(tier, const void* data, const step_chunk& layout)`. */
  template <class F>
  void for_each_grad_chunk(F&& f) const {
    for (std::uint32_t c = 0; c < plan_.num_chunks; ++c) {
      const auto& s = slot({chunk_kind::grad, c});
      if (s.where == tier::none) continue;
      wait_pending(const_cast<chunk_slot&>(s));
      step_chunk view{.index = c, .where = s.where, .param_type = options_.param_type, .elems = plan_.chunk_elems, .grad = s.data,
                      .tensors = plan_.chunk_tensors[c], .slots = plan_.slots, .specs = specs_};
      f(view);
    }
  }

  /** @brief Drops every gradient (FREE): the next backward use starts from zero. Use it to skip a
   *  step (fp16 overflow) or to start a new accumulation. */
  void zero_grad() {
    require_no_compute("zero_grad");
    for (std::uint32_t c = 0; c < plan_.num_chunks; ++c) release_grad(c);
  }

  /** @brief Ends an iteration without a step (e.g. after an evaluation pass, or a skipped step):
   *  HOLD_AFTER_* tensors return to HOLD and the tracer closes the iteration. */
  void end_iteration() {
    require_no_compute("end_iteration");
    if (untraced_) throw state_error("end_iteration() inside an untraced section: close the section first");
    for (std::size_t t = 0; t < states_.size(); ++t) states_[t] = transition(states_[t], tensor_event::end_iteration, specs_[t].name);
    if (iteration_open_) tracer_.end_iteration();
    iteration_open_ = false;
  }

  /** @brief While alive, scopes are not traced: evaluation passes, sampling and other work that
   *  is not part of the training iteration. Decisions fall back to trace-free behaviour (current-use
   *  budgets, LRU order, no prefetch), so the training trace stays valid and is not re-recorded.
   *  On destruction the parameters used return to HOLD. Not nestable; no scope may outlive it. */
  class untraced_section {
   public:
    untraced_section(untraced_section&& o) noexcept : rt_(std::exchange(o.rt_, nullptr)) {}
    untraced_section& operator=(untraced_section&&) = delete;
    ~untraced_section() {
      if (!rt_) return;
      rt_->untraced_ = false;
      for (std::size_t t = 0; t < rt_->states_.size(); ++t)
        if (rt_->states_[t] == tensor_state::hold_after_fwd || rt_->states_[t] == tensor_state::hold_after_bwd)
          rt_->states_[t] = tensor_state::hold;
    }

   private:
    friend class chunk_runtime;
    explicit untraced_section(chunk_runtime* rt) : rt_(rt) { rt_->untraced_ = true; }
    chunk_runtime* rt_;
  };

  /** @brief Starts an untraced section (see untraced_section). */
  [[nodiscard]] untraced_section untraced() {
    require_finalized("untraced");
    require_no_compute("untraced");
    if (untraced_) throw state_error("untraced() while an untraced section is already open: close it first");
    return untraced_section(this);
  }

  // ---------------------------------------------------------------------------------------------
  // Reading and writing tensors wherever they live (checkpoints, tests)

  /** @brief Copies parameter @p p's data in list @p k to @p out as fp32 (any tier; no chunk moves). */
  void read_tensor(param_id p, chunk_kind k, std::span<float> out) const {
    const auto& sl = plan_.slots.at(p.value);
    check_size(p, out.size());
    const auto& s = slot({k, static_cast<std::uint32_t>(sl.chunk)});
    const dtype t = list(k).desc.type;
    if (s.where == tier::none) {
      std::fill(out.begin(), out.end(), 0.0f);
      return;
    }
    wait_pending(const_cast<chunk_slot&>(s));
    std::vector<std::byte> staging;
    const std::byte* src = static_cast<const std::byte*>(s.data) + sl.offset * dtype_size(t);
    if (s.where == tier::device && !device_is_host_accessible) {
      staging.resize(out.size() * dtype_size(t));
      copier_.copy(staging.data(), src, staging.size(), copy_direction::to_host);
      src = staging.data();
    }
    widen(src, t, out);
  }

  /** @brief Overwrites parameter @p p's data in list @p k from fp32 @p values (narrowed with RNE). */
  void write_tensor(param_id p, chunk_kind k, std::span<const float> values) {
    check_size(p, values.size());
    write_tensor_values(p.value, k, values);
  }

  // ---------------------------------------------------------------------------------------------
  // Introspection

  [[nodiscard]] const runtime_stats& stats() const noexcept { return stats_; }
  void reset_stats() noexcept { stats_ = {}; }
  [[nodiscard]] const chunk_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] std::span<const tensor_spec> params() const noexcept { return specs_; }
  [[nodiscard]] const tensor_spec& spec(param_id p) const { return specs_.at(p.value); }
  [[nodiscard]] const runtime_options& options() const noexcept { return options_; }
  [[nodiscard]] TracerT& tracer() noexcept { return tracer_; }
  [[nodiscard]] const TracerT& tracer() const noexcept { return tracer_; }
  [[nodiscard]] Comm& communicator() noexcept { return comm_; }
  [[nodiscard]] const Placement& placement() const noexcept { return placement_; }
  [[nodiscard]] timeline& timeline_recorder() noexcept { return timeline_; }
  [[nodiscard]] device_space_type& device_space() noexcept { return device_; }
  [[nodiscard]] host_space_type& host_space() noexcept { return host_; }
  [[nodiscard]] copy_engine_type& copy_engine() noexcept { return copier_; }
  /** @brief Chunk bytes the compute tier may hold at the current moment (placement budget, capped
   *  by what non-model data leaves). A scope's working set is admitted even above it. */
  [[nodiscard]] std::size_t chunk_budget() const { return budget_now(); }
  /** @brief Bytes of chunk payloads on the compute tier now (including loads in flight). */
  [[nodiscard]] std::size_t device_chunk_bytes() const noexcept { return resident_[0]; }
  [[nodiscard]] std::size_t host_chunk_bytes() const noexcept { return resident_[1]; }
  [[nodiscard]] std::size_t non_model_bytes() const noexcept { return non_model_; }
  /** @brief Bytes of model data over all lists (what must fit in device + host). */
  [[nodiscard]] std::size_t model_bytes() const noexcept {
    std::size_t b = 0;
    for (const auto& l : lists_)
      if (l.present && !l.desc.aliases_param) b += l.desc.chunk_bytes * l.desc.num_chunks;
    return b;
  }
  /** @brief Where chunk @p id's payload lives. */
  [[nodiscard]] tier where(chunk_id id) const { return slot(id).where; }
  /** @brief The derived state of a chunk (PatrickStar): COMPUTE if any tensor is, else HOLD..., FREE. */
  [[nodiscard]] tensor_state chunk_state(chunk_id id) const {
    if (id.kind == chunk_kind::grad && slot(id).where == tier::none) return tensor_state::free;
    tensor_state best = tensor_state::free;
    for (auto t : plan_.chunk_tensors.at(id.index)) {
      const auto s = states_[t];
      if (s == tensor_state::compute) return s;
      if (best == tensor_state::free || static_cast<int>(s) < static_cast<int>(best)) best = s;
    }
    return best;
  }
  [[nodiscard]] tensor_state state(param_id p) const { return states_.at(p.value); }
  /** @brief Owner rank of chunk index @p c (ZeRO: chunk c belongs to rank c mod N). */
  [[nodiscard]] int owner(std::size_t c) const { return list(chunk_kind::param).chunks.at(c).owner; }

  /** @brief Moves chunk @p id to the host now (a test and tooling hook; the runtime does this itself).
   *  @throws state_error if a tensor of the chunk is in COMPUTE. */
  void offload(chunk_id id) {
    auto& s = slot(id);
    if (s.pinned || chunk_state(id) == tensor_state::compute)
      throw state_error("cannot move chunk " + to_string(id) + ": a tensor in it is in COMPUTE; close its scope first");
    make_resident_on_host(id);
  }

  /** @brief Capacity, use, peak and largest free block of every space, plus the runtime's view. */
  [[nodiscard]] memory_report memory_report_now() const {
    memory_report r;
    r.spaces.push_back(device_.usage());
    r.spaces.push_back(host_.usage());
    r.spaces.push_back({"chunks on device", device_.capacity(), resident_[0], stats_.peak_device_chunk_bytes, 0});
    r.spaces.push_back({"non-model on device", device_.capacity(), non_model_, stats_.peak_non_model_bytes, 0});
    return r;
  }

 private:
  static constexpr bool device_is_host_accessible = can_access_v<host_exec, device_space_type>;

  using copy_handle = decltype(std::declval<copy_engine_type&>().copy_async(nullptr, nullptr, 0, copy_direction::to_device));

  /** A payload buffer an in-flight copy still reads (the chunk has moved on); freed once `done`. */
  struct retiring_buffer {
    copy_handle done;
    void* buffer = nullptr;  // null once a load took it over (device_buffer)
    tier where = tier::none;
    std::size_t bytes = 0;
    double submitted_us = 0;
  };

  struct chunk_slot {
    tier where = tier::none;       // logical tier; decisions use only logical state (deterministic)
    void* data = nullptr;          // payload in `where` (valid once `pending` is ready)
    std::optional<copy_handle> pending;  // the copy (or zero fill) into `data`, until seen complete
    std::size_t last_use = 0;      // LRU tick
    std::uint32_t pinned = 0;      // open scopes / steps using it: never moves while > 0
    bool prefetched = false;       // loaded ahead and not yet used by a scope
    int owner = 0;
  };
  struct chunk_list {
    bool present = false;
    chunk_list_desc desc;
    std::vector<chunk_slot> chunks;
  };

  // --- small helpers -----------------------------------------------------------------------------
  [[nodiscard]] bool has(chunk_kind k) const noexcept { return lists_[static_cast<std::size_t>(k)].present; }
  [[nodiscard]] chunk_list& list(chunk_kind k) { return lists_[static_cast<std::size_t>(k)]; }
  [[nodiscard]] const chunk_list& list(chunk_kind k) const { return lists_[static_cast<std::size_t>(k)]; }
  [[nodiscard]] chunk_slot& slot(chunk_id id) { return list(id.kind).chunks.at(id.index); }
  [[nodiscard]] const chunk_slot& slot(chunk_id id) const { return list(id.kind).chunks.at(id.index); }
  [[nodiscard]] std::size_t bytes_of(chunk_kind k) const { return list(k).desc.chunk_bytes; }

  void require_finalized(const char* what) const {
    if (!finalized_) throw state_error(std::string(what) + "() before finalize(): register parameters and call finalize() first");
  }
  void require_no_compute(const char* what) const {
    for (std::size_t t = 0; t < states_.size(); ++t)
      if (states_[t] == tensor_state::compute)
        throw state_error(std::string(what) + "() while parameter '" + specs_[t].name +
                          "' is in COMPUTE: close every open scope first");
  }
  void check_size(param_id p, std::size_t n) const {
    if (n != specs_.at(p.value).numel())
      throw config_error("buffer of " + std::to_string(n) + " elements for parameter '" + specs_[p.value].name +
                         "' of " + std::to_string(specs_[p.value].numel()) + " elements: pass a buffer of its size");
  }

  void count_resident(tier t, std::size_t bytes, int sign) {
    if (t == tier::none) return;
    auto& r = resident_[t == tier::device ? 0 : 1];
    r = sign > 0 ? r + bytes : r - bytes;
    stats_.peak_device_chunk_bytes = std::max(stats_.peak_device_chunk_bytes, resident_[0]);
    stats_.peak_host_chunk_bytes = std::max(stats_.peak_host_chunk_bytes, resident_[1]);
  }

  void sample_counters() {
    if (!timeline_.enabled()) return;
    timeline_.counter("device", {{"chunks", static_cast<double>(resident_[0])}, {"non_model", static_cast<double>(non_model_)}});
    timeline_.counter("host", {{"chunks", static_cast<double>(resident_[1])}});
  }

  [[nodiscard]] placement_inputs inputs() const { return inputs(tracer_.current_moment()); }

  /** The placement's view at moment @p m of the trace (the current non-model use is today's). */
  [[nodiscard]] placement_inputs inputs(std::size_t m) const {
    placement_inputs in;
    in.device_capacity = device_.capacity();
    in.non_model_now = non_model_;
    in.trace_ready = tracer_.ready() && !untraced_;
    if (in.trace_ready) {
      // The current moment's peak from here on (it falls once its activations are freed).
      in.non_model_peak_here = m == tracer_.current_moment() ? tracer_.non_model_peak_from(m, non_model_changes_)
                                                             : tracer_.non_model_peak(m);
      in.non_model_peak_next = tracer_.non_model_peak(m + 1);
      in.non_model_peak_max = trace_peak_max();
    }
    for (const auto& l : lists_) {
      if (!l.present) continue;
      in.total_chunk_bytes += l.desc.chunk_bytes * l.desc.num_chunks;
      in.step_chunk_bytes += l.desc.chunk_bytes;
      if (l.desc.kind == chunk_kind::param || l.desc.kind == chunk_kind::grad)
        in.compute_chunk_bytes += l.desc.chunk_bytes * l.desc.num_chunks;
    }
    in.num_chunks = plan_.num_chunks;
    return in;
  }

  /** Chunk bytes the compute tier may hold now: the policy's budget, never above what the device has
   *  left after non-model data. */
  /** The trace's highest non-model peak; recomputed only when the trace or a recorded peak changed
   *  (budgets are asked for at every moment, the trace changes rarely). */
  [[nodiscard]] std::size_t trace_peak_max() const {
    const auto st = tracer_.stats();
    const std::pair<std::size_t, std::size_t> key{st.traces, st.memory_divergences};
    if (key != peak_max_key_) {
      peak_max_ = 0;
      for (std::size_t i = 0; i < tracer_.num_moments(); ++i) peak_max_ = std::max(peak_max_, tracer_.non_model_peak(i));
      peak_max_key_ = key;
    }
    return peak_max_;
  }

  [[nodiscard]] std::size_t budget_now() const { return budget_at(tracer_.current_moment()); }

  [[nodiscard]] std::size_t budget_at(std::size_t m) const {
    const auto in = inputs(m);
    return std::min(placement_.chunk_budget(in), room_after(in.device_capacity, in.non_model_now));
  }

  // --- payloads ------------------------------------------------------------------------------------
  void* allocate_payload(std::size_t bytes, tier preferred, bool may_spill, tier& got) {
    const std::size_t a = options_.payload_alignment;
    void* p = preferred == tier::host ? host_.try_allocate(bytes, a) : device_.try_allocate(bytes, a);
    got = preferred;
    if (p == nullptr && may_spill) {
      p = preferred == tier::host ? device_.try_allocate(bytes, a) : host_.try_allocate(bytes, a);
      got = preferred == tier::host ? tier::device : tier::host;
    }
    if (p == nullptr)
      throw out_of_memory_error("model data does not fit: a chunk of " + format_bytes(bytes) + " found no room (model data " +
                                    format_bytes(model_bytes()) + "). Raise the host or device budget, or train a smaller model",
                                bytes, memory_report_now());
    return p;
  }

  void free_payload(chunk_slot& s, std::size_t bytes) noexcept {
    if (s.data == nullptr) return;
    if (s.where == tier::device) device_.deallocate(s.data, bytes, options_.payload_alignment);
    else host_.deallocate(s.data, bytes, options_.payload_alignment);
    s.data = nullptr;
    s.where = tier::none;
  }

  void zero_device(void* p, std::size_t bytes) {
    if constexpr (device_is_host_accessible) std::memset(p, 0, bytes);
    else copier_.zero_async(p, bytes).wait();
  }

  // --- transfers -----------------------------------------------------------------------------------
  /** Waits until a slot's payload has arrived (stall time counted); rethrows a failed copy. */
  void wait_pending(chunk_slot& s) const {
    if (!s.pending) return;
    auto* self = const_cast<chunk_runtime*>(this);
    if (!s.pending->ready()) {
      const auto t0 = std::chrono::steady_clock::now();
      s.pending->wait();
      self->stats_.stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    s.pending->wait();
    s.pending.reset();
  }

  /** Frees a retiring buffer (its copy is done) and records the copy on the timeline. */
  void release_buffer(retiring_buffer& r) noexcept {
    if (r.buffer != nullptr) {
      if (r.where == tier::device) device_.deallocate(r.buffer, r.bytes, options_.payload_alignment);
      else host_.deallocate(r.buffer, r.bytes, options_.payload_alignment);
      r.buffer = nullptr;
    }
    timeline_.span(r.where == tier::device ? timeline::track::to_host : timeline::track::to_device, "chunk",
                   r.submitted_us, timeline_.now_us());
  }

  /** Frees the buffers of finished copies and forgets finished slot copies; never waits. */
  void retire_completed() {
    std::erase_if(retiring_, [&](retiring_buffer& r) {
      if (!r.done.ready()) return false;
      release_buffer(r);
      return true;
    });
    for (auto& l : lists_)
      for (auto& s : l.chunks)
        if (s.pending && s.pending->ready()) wait_pending(s);
  }

  /** A device buffer of @p bytes for a job on @p lane that never blocks the caller: a free one when
   *  the device has room for it and for the non-model memory this moment may still allocate; else
   *  the buffer of the oldest eviction still in flight (same size), with @p lane ordered after that
   *  eviction's copy (so activations never wait for an eviction to finish); else a free one if any.
   *  Null when none exists. */
  void* device_buffer(std::size_t bytes, copy_direction lane) {
    std::size_t in_use = resident_[0] + non_model_;
    for (const auto& r : retiring_)
      if (r.buffer != nullptr && r.where == tier::device) in_use += r.bytes;
    std::size_t growth = 0;  // non-model bytes the trace says may still come in this moment
    if (tracer_.ready() && !untraced_) {
      const auto m = tracer_.current_moment();
      growth = room_after(std::max(tracer_.non_model_peak(m), tracer_.non_model_peak(m + 1)), non_model_);
    }
    if (in_use + bytes + growth <= device_.capacity())
      if (void* p = device_.try_allocate(bytes, options_.payload_alignment)) return p;
    for (auto& r : retiring_) {  // oldest first
      if (r.buffer == nullptr || r.where != tier::device || r.bytes != bytes) continue;
      copier_.order_after(r.done, lane);
      ++stats_.buffer_reuses;
      return std::exchange(r.buffer, nullptr);  // the eviction no longer frees it: it is ours
    }
    return device_.try_allocate(bytes, options_.payload_alignment);
  }

  /** Frees the buffers on tier @p from whose copies are done, or else waits for the oldest copy
   *  still reading one; false if no copy reads a buffer on @p from. */
  bool retire_one_pending(tier from) {
    const auto before = retiring_.size();
    retire_completed();
    if (retiring_.size() != before) return true;
    for (auto& r : retiring_) {
      if (r.buffer == nullptr || r.where != from) continue;
      const auto t0 = std::chrono::steady_clock::now();
      r.done.wait();
      stats_.stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      retire_completed();
      return true;
    }
    return false;
  }

  /** Starts moving a slot's payload to @p to; the logical tier changes at once. */
  enum class move_reason { load, evict, offload };

  void start_move(chunk_id id, tier to, move_reason why) {
    auto& s = slot(id);
    if (s.pinned)  // the invariant every caller must keep: a chunk in use never moves
      throw state_error("internal: chunk " + to_string(id) + " is in use and cannot move to the " +
                        std::string(tier_name(to)) + "; please report this as a chunkstar bug");
    const std::size_t bytes = bytes_of(id.kind);
    const std::size_t a = options_.payload_alignment;
    const auto dir = to == tier::device ? copy_direction::to_device : copy_direction::to_host;
    void* dst = to == tier::device ? device_buffer(bytes, dir) : nullptr;
    for (;;) {
      if (dst == nullptr) dst = to == tier::device ? device_.try_allocate(bytes, a) : host_.try_allocate(bytes, a);
      if (dst != nullptr || !retire_one_pending(to)) break;
    }
    if (dst == nullptr) {
      throw out_of_memory_error("no room on the " + std::string(tier_name(to)) + " for chunk " + to_string(id) + " (" +
                                    format_bytes(bytes) + ")" +
                                    (to == tier::host ? ": host and device are both full; raise the host budget"
                                                      : ": the device is full of non-model data; raise the device budget"),
                                bytes, memory_report_now());
    }
    // A chunk may move again before its last copy landed: this copy reads it only after that one.
    if (s.pending && !s.pending->ready()) copier_.order_after(*s.pending, dir);
    s.pending = copier_.copy_async(dst, s.data, bytes, dir);
    retiring_.push_back({*s.pending, s.data, s.where, bytes, timeline_.now_us()});
    count_resident(s.where, bytes, -1);
    s.data = dst;
    s.where = to;
    count_resident(to, bytes, +1);
    (to == tier::device ? stats_.bytes_to_device : stats_.bytes_to_host) += bytes;
    ++(why == move_reason::load ? stats_.loads : why == move_reason::evict ? stats_.evictions : stats_.offloads);
  }

  // --- eviction ------------------------------------------------------------------------------------
  /** Evicts one chunk from the compute tier (not pinned, not in @p keep; one still being loaded
   *  leaves once it has arrived, ordered on the copy engine).
   *  @p reference_moment: next uses are measured from it. Returns false when nothing can go. */
  bool evict_one(const std::unordered_set<chunk_id>& keep, std::size_t reference_moment) {
    collect_candidates(reference_moment, [&](chunk_id id, const chunk_slot& s) -> std::optional<std::size_t> {
      if (s.where != tier::device || s.pinned || keep.contains(id)) return std::nullopt;
      return s.last_use;
    });
    if (candidates_.empty()) return false;
    const auto victim = candidates_[eviction_.pick(candidates_)].id;
    slot(victim).prefetched = false;
    start_move(victim, tier::host, move_reason::evict);
    return true;
  }

  /** Fills candidates_ with the chunks @p eligible accepts — `eligible(id, slot)` returns the
   *  chunk's LRU tick, or nothing — with next uses measured from @p reference (`never`: none).
   *  The demand path and prefetch's simulation of it share this, so both see the same candidates. */
  template <class Eligible>
  void collect_candidates(std::size_t reference, Eligible&& eligible) {
    candidates_.clear();
    for (std::size_t k = 0; k < num_chunk_kinds; ++k) {
      const auto& l = lists_[k];
      if (!l.present) continue;
      for (std::uint32_t c = 0; c < l.chunks.size(); ++c) {
        const chunk_id id{static_cast<chunk_kind>(k), c};
        const std::optional<std::size_t> tick = eligible(id, l.chunks[c]);
        if (!tick) continue;
        std::size_t next = never;
        if constexpr (Eviction::uses_trace) {
          if (reference != never) next = tracer_.next_use(id, reference);
        }
        candidates_.push_back({id, l.desc.chunk_bytes, *tick, next});
      }
    }
  }

  /** Makes every chunk in @p ids resident on the compute tier within the budget. */
  void make_resident_on_device(const std::vector<chunk_id>& ids, std::string_view who, std::size_t m) {
    const std::unordered_set<chunk_id> keep(ids.begin(), ids.end());
    std::size_t working = 0;
    for (auto id : ids) working += bytes_of(id.kind);
    const std::size_t hard = room_after(device_.capacity(), non_model_);
    if (working > hard)
      throw out_of_memory_error("scope '" + std::string(who) + "' needs " + format_bytes(working) +
                                    " of chunks on the compute tier but only " + format_bytes(hard) +
                                    " is left after non-model data: raise the device budget to at least " +
                                    format_bytes(working + non_model_) + ", or use smaller chunks",
                                working, memory_report_now());
    const std::size_t budget = std::max(budget_now(), working);
    for (auto id : ids) {
      auto& s = slot(id);
      if (s.where == tier::device) continue;
      // Within the budget if possible; the budget is soft (it anticipates later activations), only
      // the device's room is hard.
      while (resident_[0] + bytes_of(id.kind) > budget) {
        if (evict_one(keep, m)) continue;
        if (resident_[0] + bytes_of(id.kind) <= hard) break;
        throw out_of_memory_error("scope '" + std::string(who) + "' needs " + format_bytes(working) +
                                      " of chunks on the compute tier but nothing more can be evicted",
                                  working, memory_report_now());
      }
      if (s.where == tier::none) {
        materialise(id, tier::device);
      } else {
        ++stats_.demand_loads;
        start_move(id, tier::device, move_reason::load);
      }
    }
    // The budget may have shrunk since the last moment (the tide): give back the surplus now, before
    // this moment's activations need it.
    while (resident_[0] > budget && evict_one(keep, m)) {
    }
    for (auto id : ids) {
      auto& s = slot(id);
      if (s.prefetched) {
        ++stats_.prefetch_hits;
        s.prefetched = false;
      }
      wait_pending(s);
    }
  }

  void make_resident_on_host(chunk_id id) {
    auto& s = slot(id);
    if (s.where == tier::none) {
      materialise(id, tier::host);
    } else if (s.where == tier::device) {
      s.prefetched = false;
      start_move(id, tier::host, move_reason::offload);
    }
    wait_pending(s);
  }

  /** Gives a FREE chunk a zeroed payload on @p where. */
  void materialise(chunk_id id, tier where) {
    auto& s = slot(id);
    const std::size_t bytes = bytes_of(id.kind);
    s.data = where == tier::device ? device_buffer(bytes, copy_direction::host_to_host) : nullptr;
    for (;;) {
      if (!s.data) s.data = where == tier::device ? device_.try_allocate(bytes, options_.payload_alignment)
                                                  : host_.try_allocate(bytes, options_.payload_alignment);
      if (s.data || !retire_one_pending(where)) break;
    }
    if (!s.data)
      throw out_of_memory_error("no room on the " + std::string(tier_name(where)) + " for chunk " + to_string(id) + " (" +
                                    format_bytes(bytes) + "): raise that tier's budget",
                                bytes, memory_report_now());
    s.where = where;
    if (where == tier::device) {
      // Zeroed on the copy engine's local lane (a device memset): the scope using it waits for
      // it, and a prefetched gradient is zeroed while the previous layer computes.
      s.pending = copier_.zero_async(s.data, bytes);
    } else {
      std::memset(s.data, 0, bytes);
    }
    count_resident(where, bytes, +1);
    ++stats_.materialised;
  }

  /** Prefetch during moment @p m: replays, on today's state, what make_resident_on_device will do
   *  at the coming moments of the trace, and does those evictions and loads now, in the same order,
   *  so the copies run under compute. The simulated state evolves as the real one will: the chunks
   *  in use now are released, a step releases its gradient, LRU ticks advance with the accesses,
   *  budgets follow the placement. The same eviction strategy then picks the same victims, so
   *  prefetch moves exactly the bytes the demand path would, only earlier (bench_replay checks this
   *  against the offline optimum). Carrying out stops at the first step that cannot happen yet: a
   *  victim in use now or used before its planned eviction, a load that does not fit the smallest
   *  budget until its use, a chunk @p skip rejects, or more than `prefetch_depth` loads in flight
   *  (the next moment's loads are always started). */
  void prefetch(std::size_t m) {
    prefetch(m, [](chunk_id) { return false; });
  }

  /** As prefetch(m), never loading a chunk for which @p skip returns true. */
  template <class Skip>
  void prefetch(std::size_t m, Skip&& skip) {
    if (options_.prefetch_depth == 0 || !tracer_.ready() || untraced_ || m == never) return;
    const std::size_t n = tracer_.num_moments();
    if (n == 0) return;
    refresh_moment_needs();
    const std::size_t per_kind = plan_.num_chunks;
    auto dense = [&](chunk_id id) { return static_cast<std::size_t>(id.kind) * per_kind + id.index; };

    // The simulated state: what is on the compute tier, and the LRU ticks. Loads still in flight
    // count against the depth.
    sim_on_device_.assign(num_chunk_kinds * per_kind, 0);
    sim_last_use_.assign(num_chunk_kinds * per_kind, 0);
    sim_keep_.assign(num_chunk_kinds * per_kind, 0);
    std::size_t resident = 0, tick = tick_, in_flight = 0;
    for (std::size_t k = 0; k < num_chunk_kinds; ++k) {
      if (!lists_[k].present) continue;
      for (std::uint32_t c = 0; c < per_kind; ++c) {
        const auto& sl = lists_[k].chunks[c];
        sim_last_use_[k * per_kind + c] = sl.last_use;
        if (sl.where == tier::device) {
          sim_on_device_[k * per_kind + c] = 1;
          resident += lists_[k].desc.chunk_bytes;
          if (sl.prefetched && sl.pending && !sl.pending->ready()) ++in_flight;
        }
      }
    }
    auto sim_drop = [&](chunk_id id) {
      if (std::exchange(sim_on_device_[dense(id)], 0)) resident -= bytes_of(id.kind);
    };

    std::size_t releases = step_chunk_;  // a step frees its gradient when its moment ends
    std::size_t fits = budget_now();     // smallest budget of the moments from now to the planned one
    for (std::size_t d = 1; d < n; ++d) {
      const std::size_t k = (m + d) % n;
      if (releases != never) sim_drop({chunk_kind::grad, static_cast<std::uint32_t>(releases)});
      releases = never;
      const auto& needed = moment_needs_[k];
      for (auto id : needed) sim_last_use_[dense(id)] = ++tick;
      if (tracer_.kind_of(k) == moment_kind::optimizer) {
        if (needed.empty()) return;  // a host-side step: its moves are the step's own, not simulated
        releases = needed.front().index;
      }

      // make_resident_on_device at moment k, simulated. Its budget: its non-model use when it
      // opens is within its recorded peak.
      auto at_k = inputs(k);
      at_k.non_model_now = tracer_.non_model_peak(k);
      std::size_t working = 0;
      for (auto id : needed) {
        working += bytes_of(id.kind);
        sim_keep_[dense(id)] = 1;
      }
      const std::size_t budget = std::max(placement_.chunk_budget(at_k), working);
      const bool done = [&] {
        auto evict = [&]() -> bool {  // the victim evict_one would pick at moment k
          collect_candidates(k, [&](chunk_id id, const chunk_slot&) -> std::optional<std::size_t> {
            const std::size_t x = dense(id);
            if (!sim_on_device_[x] || sim_keep_[x]) return std::nullopt;
            return sim_last_use_[x];
          });
          if (candidates_.empty()) return false;
          const auto victim = candidates_[eviction_.pick(candidates_)].id;
          sim_drop(victim);
          auto& v = slot(victim);
          // Early only if nothing uses it before moment k: not now, not in between.
          if (v.pinned || tracer_.next_use(victim, m) < d) return false;
          v.prefetched = false;
          start_move(victim, tier::host, move_reason::evict);
          return true;
        };
        for (auto id : needed) {
          if (sim_on_device_[dense(id)]) continue;
          const std::size_t bytes = bytes_of(id.kind);
          while (resident + bytes > budget)
            if (!evict()) return false;
          auto& s = slot(id);
          // On the device for real, absent only in the simulation: a gradient whose step (and
          // release) is still to come. Loading it is for after that release, not now.
          if (s.where == tier::device || s.pinned || skip(id) || resident_[0] + bytes > fits) return false;
          const bool transfer = s.where == tier::host;
          if (transfer && d > 1 && in_flight >= options_.prefetch_depth) return false;
          sim_on_device_[dense(id)] = 1;
          resident += bytes;
          if (transfer) {
            start_prefetch(id);
            ++in_flight;
          } else {
            materialise(id, tier::device);  // a FREE gradient: a zero fill, not a transfer (no hit)
            s.last_use = ++tick_;  // like a fetched chunk: prepared now, not the stalest
          }
        }
        while (resident > budget)  // the tide goes out: the surplus leaves too
          if (!evict()) return false;
        return true;
      }();
      for (auto id : needed) sim_keep_[dense(id)] = 0;
      if (!done) return;
      fits = std::min(fits, budget_at(k));
    }
  }

  /** The distinct chunks each moment of the trace uses, in order of use; rebuilt when the trace is. */
  void refresh_moment_needs() {
    const auto key = tracer_.stats().traces;
    if (key == moment_needs_key_ && moment_needs_.size() == tracer_.num_moments()) return;
    moment_needs_.assign(tracer_.num_moments(), {});
    for (const auto& a : tracer_.accesses()) {
      auto& v = moment_needs_.at(a.moment);
      if (std::find(v.begin(), v.end(), a.id) == v.end()) v.push_back(a.id);
    }
    moment_needs_key_ = key;
  }

  void start_prefetch(chunk_id id) {
    auto& s = slot(id);
    start_move(id, tier::device, move_reason::load);
    s.prefetched = true;
    s.last_use = ++tick_;  // for LRU, a chunk just fetched is not the stalest
    ++stats_.prefetches;
  }

  /** Drops chunk @p c's gradient payload (FREE): the next backward use starts from zero. */
  void release_grad(std::uint32_t c) {
    auto& s = slot({chunk_kind::grad, c});
    if (s.where == tier::none) return;
    wait_pending(s);
    count_resident(s.where, bytes_of(chunk_kind::grad), -1);
    free_payload(s, bytes_of(chunk_kind::grad));
    s.prefetched = false;
  }

  /** While chunk @p c steps, start moving the next host-stepped chunks' lists down, so their
   *  copies overlap this chunk's step instead of stalling the next one. */
  void offload_ahead(std::uint32_t c) {
    for (std::uint32_t next = c + 1, n = 0; next < plan_.num_chunks && n < options_.prefetch_depth; ++next, ++n) {
      if (placement_.optimizer_tier(inputs(), next) != tier::host) continue;
      for (std::size_t k = 0; k < num_chunk_kinds; ++k) {
        if (!lists_[k].present) continue;
        const chunk_id id{static_cast<chunk_kind>(k), next};
        auto& s = slot(id);
        if (s.where != tier::device || s.pinned) continue;
        s.prefetched = false;
        start_move(id, tier::host, move_reason::offload);
      }
    }
  }

  // --- scopes --------------------------------------------------------------------------------------
  void touch(chunk_id id) {
    slot(id).last_use = ++tick_;
    if (!untraced_) tracer_.record_access(id);
  }

  void open_scope(moment_kind kind, std::string_view name, const std::vector<param_id>& params) {
    require_finalized(kind == moment_kind::forward ? "forward" : "backward");
    if (!iteration_open_ && !untraced_) {
      tracer_.begin_iteration();
      iteration_open_ = true;
    }
    const auto t0 = timeline_.now_us();
    const std::size_t m = untraced_ ? never : tracer_.open_moment(kind, name);
    non_model_changes_ = 0;
    retire_completed();
    std::vector<chunk_id> ids;
    for (auto p : params) {
      if (p.value >= specs_.size()) throw config_error("scope '" + std::string(name) + "' names an unknown param_id " + std::to_string(p.value));
      const auto c = static_cast<std::uint32_t>(plan_.slots[p.value].chunk);
      for (auto k : {chunk_kind::param, chunk_kind::grad}) {
        if (k == chunk_kind::grad && kind != moment_kind::backward) continue;
        const chunk_id id{k, c};
        if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
      }
    }
    for (auto id : ids) touch(id);
    make_resident_on_device(ids, name, m);
    for (auto id : ids) ++slot(id).pinned;
    for (auto p : params) {
      if (refs_[p.value]++ == 0) states_[p.value] = transition(states_[p.value], tensor_event::open_scope, specs_[p.value].name);
    }
    ++stats_.scopes;
    sample_counters();
    prefetch(m);
    timeline_.span(timeline::track::compute, std::string(moment_kind_name(kind)) + " load " + std::string(name), t0,
                   timeline_.now_us());
    scope_begin_us_ = timeline_.now_us();
  }

  void close_scope(moment_kind kind, const std::vector<param_id>& params) noexcept {
    std::unordered_set<chunk_id> seen;
    for (auto p : params) {
      const auto c = static_cast<std::uint32_t>(plan_.slots[p.value].chunk);
      for (auto k : {chunk_kind::param, chunk_kind::grad}) {
        if (k == chunk_kind::grad && kind != moment_kind::backward) continue;
        if (seen.insert({k, c}).second) --slot({k, c}).pinned;
      }
      if (--refs_[p.value] == 0)
        states_[p.value] = kind == moment_kind::forward ? tensor_state::hold_after_fwd : tensor_state::hold_after_bwd;
    }
    timeline_.span(timeline::track::compute, moment_kind_name(kind), scope_begin_us_, timeline_.now_us());
  }

  template <class T>
  std::span<T> tensor_span(param_id p, chunk_kind k, const std::vector<param_id>& in_scope) {
    if (dtype_of_v<std::remove_const_t<T>> != options_.param_type)
      throw config_error("parameter '" + specs_.at(p.value).name + "' is " + std::string(dtype_name(options_.param_type)) +
                         ", not " + std::string(dtype_name(dtype_of_v<std::remove_const_t<T>>)) + ": ask for its dtype");
    if (std::find(in_scope.begin(), in_scope.end(), p) == in_scope.end())
      throw state_error("parameter '" + specs_[p.value].name + "' is not part of this scope: list it when opening the scope");
    const auto& sl = plan_.slots[p.value];
    auto& s = slot({k, static_cast<std::uint32_t>(sl.chunk)});
    return {static_cast<T*>(s.data) + sl.offset, sl.numel};
  }

  // --- values --------------------------------------------------------------------------------------
  static void widen(const std::byte* src, dtype t, std::span<float> out) {
    switch (t) {
      case dtype::f32: std::memcpy(out.data(), src, out.size_bytes()); break;
      case dtype::f16:
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = to_float(reinterpret_cast<const float16*>(src)[i]);
        break;
      case dtype::bf16:
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = to_float(reinterpret_cast<const bfloat16*>(src)[i]);
        break;
    }
  }

  void write_tensor_values(std::size_t t, chunk_kind k, std::span<const float> values) {
    const auto& sl = plan_.slots[t];
    auto& s = slot({k, static_cast<std::uint32_t>(sl.chunk)});
    if (s.where == tier::none) materialise({k, static_cast<std::uint32_t>(sl.chunk)}, tier::host);
    wait_pending(s);
    const dtype type = list(k).desc.type;
    std::vector<std::byte> staging(values.size() * dtype_size(type));
    switch (type) {
      case dtype::f32: std::memcpy(staging.data(), values.data(), values.size_bytes()); break;
      case dtype::f16:
        for (std::size_t i = 0; i < values.size(); ++i) reinterpret_cast<float16*>(staging.data())[i] = float16(values[i]);
        break;
      case dtype::bf16:
        for (std::size_t i = 0; i < values.size(); ++i) reinterpret_cast<bfloat16*>(staging.data())[i] = bfloat16(values[i]);
        break;
    }
    std::byte* dst = static_cast<std::byte*>(s.data) + sl.offset * dtype_size(type);
    if (s.where == tier::device && !device_is_host_accessible) copier_.copy(dst, staging.data(), staging.size(), copy_direction::to_device);
    else std::memcpy(dst, staging.data(), staging.size());
  }

  device_space_type& device_;
  host_space_type& host_;
  copy_engine_type& copier_;
  runtime_options options_;
  Layout layout_;
  Placement placement_;
  Eviction eviction_;
  TracerT tracer_;
  Comm comm_;

  std::vector<tensor_spec> specs_;
  std::vector<param_initializer> inits_;
  std::unordered_map<std::string, std::size_t> names_;
  chunk_plan plan_;
  std::array<chunk_list, num_chunk_kinds> lists_;
  std::vector<tensor_state> states_;
  std::vector<std::uint32_t> refs_;
  std::vector<eviction_candidate> candidates_;
  std::vector<retiring_buffer> retiring_;        // buffers in-flight copies still read, oldest first
  std::vector<char> sim_on_device_;              // prefetch's simulated state, by dense chunk index
  std::vector<std::size_t> sim_last_use_;
  std::vector<char> sim_keep_;
  std::vector<std::vector<chunk_id>> moment_needs_;  // by moment of the trace (refresh_moment_needs)
  std::size_t moment_needs_key_ = never;
  std::array<std::size_t, 2> resident_{};  // chunk bytes on device, on host
  std::size_t non_model_ = 0;
  std::size_t tick_ = 0;
  double scope_begin_us_ = 0;
  bool finalized_ = false;
  bool iteration_open_ = false;
  bool untraced_ = false;
  std::size_t step_chunk_ = never;     // the chunk index stepping now (its gradient goes at the end)
  std::size_t non_model_changes_ = 0;  // allocate/deallocate_non_model calls in this moment
  mutable std::size_t peak_max_ = 0;
  mutable std::pair<std::size_t, std::size_t> peak_max_key_{never, never};
  runtime_stats stats_;
  timeline timeline_;
};

/** @brief PatrickStar's assembly: searched layout, auto placement, Belady eviction, warm-up tracer,
 *  one process, simulated device. */
using patrickstar_runtime =
    chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction, warmup_tracer, single_process_communicator>;

}  // namespace chunkstar
