// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::sharded_model`: a rank's whole model state under RTP for any model — its rotated
 *         shards and its replicas in one shard store, the rotations reading and writing that store
 *         directly, the replicas' gradients summed over the ranks, and one optimizer step with a
 *         global norm that counts every replica once.
 *
 *  What a user's own model adds is its math: which buffers it has (`add_rotated`,
 *  `add_replicated`, with the parts of rtp/model_part.hpp) and a kernel per shard in each pass.
 *  The pieces:
 *  - **Parts.** Every buffer is a `model_part` registered in the store (`ShardStore`, host memory
 *    by default or a chunk runtime under a device budget: rtp/chunk_shard_store.hpp). Rotated
 *    parts get one `rotation` each, sharing one set of transit buffers from the store's compute
 *    tier; replicas are registered `counted_in_norm` on rank 0 only, so the store's step sums a
 *    replica's squares once over the ranks. Replicas therefore live under the same budget, and in
 *    the same checkpoints, as the shards.
 *  - **Passes.** `stage(name, backward, {parts}, f)` opens the store's stage (a chunk runtime's
 *    scope, which the tracer sees) and inside it `forward(k, f)` / `backward(k, g)` run rotation
 *    k, loading this rank's shard from the store and adding the gradient sum into it.
 *  - **Replicas.** The kernels read a replica's working copy, `replica(k)` (compute-tier memory,
 *    refreshed after every step and every write of its weights), and add their gradient contributions into
 *    `replica_grad(k)`; `reduce_replica_grads()` after a backward sums those over the ranks (rank
 *    order: the same bits everywhere) and adds them to the accumulated gradients in the store.
 *  - **Step.** `step(hyper, groups, micro_batches, max_norm)`: the store's Adam(W) over every part,
 *    clipped by the norm of the sum over ranks (one all-reduce of a double when clipping).
 *    `prepare_step` with the same arguments before the step's micro-batches starts the updates of a
 *    chunk store's host-stepped chunks inside backward (the same bits).
 *  - **Mixed precision.** With a store of 16-bit weights (`Store::element_type`, e.g. a
 *    `chunk_shard_store` of `bfloat16`) the rotations carry 16-bit shards and gradient sums (half
 *    the ring's bytes); the kernels still see float: the resident shard is widened into a float
 *    buffer, and the kernel's gradient term is rounded once into the 16-bit buffer that travels
 *    (`Ops` then models `WideningOps`). `loss_scale()` is the store's (fp16), and `step` reports a
 *    skipped step (`stepped`), alike on every rank: an overflow makes the all-reduced sum infinite.
 *  - **Sleep.** `sleep()` / `wake()` between passes free every compute-tier buffer and put the
 *    store to sleep (a chunk runtime's chunks off the device).
 *  - **Checkpoints.** It models `ShardedModel`, so `checkpoint_save_view` / `checkpoint_load_view`
 *    (rtp/checkpoint_view.hpp) save it at N ranks and load it at any M the model divides, one
 *    process included.
 *
 *  Every rank builds one from the same specs and parts of the same sizes (`finalize` checks that
 *  the ranks agree: `config_error` on every rank otherwise) and makes the same sequence of calls.
 *
 *  **Exception safety.** A pass that throws leaves the weights, the optimizer state and the owned
 *  gradients as they were (the rotations' guarantee); `step` communicates only before it writes.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/comm/step_agreement.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/rtp/buffer_ops.hpp>
#include <chunkstar/rtp/model_part.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/rotation.hpp>
#include <chunkstar/rtp/shard_store.hpp>
#include <chunkstar/rtp/transit_buffers.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace chunkstar::rtp {

/** @brief See the file comment. @p Ops works on the store's compute-tier memory (host loops by
 *  default; a device's kernels on its stream with a device store). */
template <Communicator Comm, ShardStore Store = host_shard_store, BufferOps<float> Ops = host_buffer_ops<float>>
requires(std::is_same_v<store_element_t<Store>, float> ||
         WideningOps<Ops, store_element_t<Store>>) class sharded_model {
 public:
  /** @brief What the rotations carry: the store's working weights (float, or 16-bit in mixed
   *  precision, widened for the kernels, which always see float). */
  using element_type = store_element_t<Store>;
  using rotation_type = rotation<Comm, element_type, Ops>;
  static constexpr bool mixed = !std::is_same_v<element_type, float>;

  /** @brief What `step` did. */
  struct step_result {
    double grad_norm = 0;        ///< global norm of the averaged gradients, every replica once (NaN without clipping)
    float clip_coefficient = 1;  ///< the factor clipping applied
    bool stepped = true;         ///< false: skipped on an fp16 overflow (on every rank alike)
    std::size_t early_steps = 0;  ///< this rank's chunk updates started inside backward (prepare_step)
    bool early_redone = false;    ///< those were undone and stepped again, or undone (a skipped step)
  };

  /** @brief A model of tensors @p specs on the ranks of @p comm, its buffers in @p store (not
   *  finalized yet; both held by reference and must outlive this object). */
  sharded_model(Comm& comm, Store& store, std::vector<tensor_spec> specs, Ops ops = Ops{})
      : comm_(comm), store_(store), specs_(std::move(specs)), ops_(std::move(ops)) {}
  sharded_model(const sharded_model&) = delete;
  sharded_model& operator=(const sharded_model&) = delete;
  ~sharded_model() {
    rotations_.clear();  // before the transit buffers they use
    transit_.reset();
    for (auto& b : buffers_)
      if (b.p) store_.deallocate(b.p, b.n);
    for (auto* b : {&wide_w_, &wide_g_})
      if (b->p) store_.deallocate(b->p, b->n);
  }

  /** @brief Registers this rank's shard of a rotated layer (every rank a part of the same size, in
   *  the same order). Returns the part's index. */
  std::size_t add_rotated(model_part part) { return add(std::move(part), false); }
  /** @brief Registers a replica (the same tensors on every rank). Returns the part's index. */
  std::size_t add_replicated(model_part part) { return add(std::move(part), true); }

  /** @brief Checks that every rank registered the same parts, finalizes the store, then builds the
   *  rotations, their shared transit buffers and the replicas' working copies and gradient buffers
   *  on the store's compute tier. If it throws (ranks that disagree, a compute tier too small),
   *  the object can only be destroyed. */
  void finalize() {
    if (finalized_) throw state_error("rtp::sharded_model::finalize called twice");
    std::string shape;
    for (const auto& p : parts_) shape += (p.replicated ? "r" : "s") + std::to_string(p.elems) + " ";
    std::vector<config_field> fields{{"tensors", std::to_string(specs_.size())}, {"parts", shape}};
    for (const auto& s : specs_) fields.push_back({s.name, std::to_string(s.numel())});
    require_agreement(comm_, fields, "rtp::sharded_model");
    store_.finalize();
    if constexpr (mixed)  // 16-bit transit buffers inside float allocations (elements rounded up to whole floats)
      transit_ = std::make_unique<transit_buffers<element_type>>(
          [this](std::size_t n) { return reinterpret_cast<element_type*>(store_.allocate(floats_for(n))); },
          [this](element_type* p, std::size_t n) noexcept {
            store_.deallocate(reinterpret_cast<float*>(p), floats_for(n));
          });
    else
      transit_ = std::make_unique<transit_buffers<float>>(
          [this](std::size_t n) { return store_.allocate(n); },
          [this](float* p, std::size_t n) noexcept { store_.deallocate(p, n); });
    rotations_.resize(parts_.size());
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      if (parts_[k].replicated) {
        replica_w_.push_back(take(parts_[k].elems));
        replica_g_.push_back(take(parts_[k].elems));
        replica_index_.push_back(k);
        slot_of_.push_back(replica_index_.size() - 1);
      } else {
        rotations_[k] = std::make_unique<rotation_type>(comm_, parts_[k].elems, *transit_, external_shard, ops_);
        slot_of_.push_back(SIZE_MAX);
        widest_ = std::max(widest_, parts_[k].elems);
      }
    }
    if constexpr (mixed) take_wide();
    finalized_ = true;
  }

  // ---- passes ----------------------------------------------------------------------------------

  /** @brief Runs @p f as store stage @p name over parts @p parts (the rotated parts whose passes it
   *  runs; a chunk runtime opens one scope on them). */
  template <class F>
  void stage(std::string_view name, bool backward, std::span<const std::size_t> parts, F&& f) {
    require_final("stage");
    store_.stage(name, backward, parts, f);
  }
  template <class F>
  void stage(std::string_view name, bool backward, std::initializer_list<std::size_t> parts, F&& f) {
    stage(name, backward, std::span<const std::size_t>(parts.begin(), parts.size()), std::forward<F>(f));
  }

  /** @brief Rotation @p k's forward inside a stage holding part k: `f(shard_index, shard)` once per
   *  shard (rtp/rotation.hpp). */
  template <class F>
  void forward(std::size_t k, F&& f) {
    if constexpr (mixed)  // the kernel sees the resident 16-bit shard widened
      rotation_of(k).forward([&](std::span<element_type> dst) { store_.load(k, dst); },
                             [&](int j, std::span<const element_type> s) {
                               ops_.widen(wide_w_.p, s.data(), s.size());
                               std::invoke(f, j, std::span<const float>(wide_w_.p, s.size()));
                             });
    else rotation_of(k).forward([&](std::span<float> dst) { store_.load(k, dst); }, f);
  }
  /** @brief Rotation @p k's backward inside a stage holding part k: `g(shard_index, shard, grad)`
   *  adds this rank's contribution into `grad`; the sum over the ranks is added to part k's
   *  accumulated gradient. */
  template <class G>
  void backward(std::size_t k, G&& g) {
    if constexpr (mixed)  // the kernel adds into a zeroed float buffer; its sum is this rank's term, rounded once
      rotation_of(k).backward([&](std::span<element_type> dst) { store_.load(k, dst); },
                              [&](int j, std::span<const element_type> s, std::span<element_type> grad) {
                                const std::size_t n = s.size();
                                ops_.widen(wide_w_.p, s.data(), n);
                                ops_.zero(wide_g_.p, n);
                                std::invoke(g, j, std::span<const float>(wide_w_.p, n), std::span<float>(wide_g_.p, n));
                                ops_.narrow(grad.data(), wide_g_.p, n);
                              },
                              [&](std::span<const element_type> sum) { store_.add_grad(k, sum); });
    else
      rotation_of(k).backward([&](std::span<float> dst) { store_.load(k, dst); }, g,
                              [&](std::span<const float> sum) { store_.add_grad(k, sum); });
  }

  /** @brief Replica @p k's working copy on the compute tier, for the kernels to read. */
  [[nodiscard]] const float* replica(std::size_t k) const {
    require_final("replica");
    return replica_w_.at(slot(k)).p;
  }
  /** @brief Replica @p k's gradient buffer for this backward on the compute tier: the kernels add
   *  into it; `reduce_replica_grads` sums it over the ranks into the accumulated gradient and
   *  zeroes it. */
  [[nodiscard]] float* replica_grad(std::size_t k) {
    require_final("replica_grad");
    return replica_g_.at(slot(k)).p;
  }
  /** @brief After a backward: each replica's gradient buffer summed over the ranks (in rank order,
   *  the same bits on every rank, as the rotations' sums), added to its accumulated gradient in the
   *  store (a backward stage "replica grads" per replica, so the compute tier holds one replica's
   *  chunks at a time), then zeroed. Collective. */
  void reduce_replica_grads() {
    require_final("reduce_replica_grads");
    ops_.settle();  // the kernels' contributions are written
    for (std::size_t r = 0; r < replica_g_.size(); ++r)
      reduce_replicated_grads(comm_, std::span<float>(replica_g_[r].p, replica_g_[r].n));
    for (std::size_t r = 0; r < replica_g_.size(); ++r)
      store_.stage("replica grads", true, std::span<const std::size_t>(&replica_index_[r], 1), [&] {
        store_.add_grad(replica_index_[r], std::span<const float>(replica_g_[r].p, replica_g_[r].n));
        ops_.zero(replica_g_[r].p, replica_g_[r].n);
      });
  }

  // ---- the optimizer ---------------------------------------------------------------------------

  /** @brief Before a step's micro-batches, with a store that can (`chunk_shard_store::prepare`):
   *  the host-stepped chunks' updates start inside the last backward, each once its gradient is
   *  final, and `step` with the same arguments keeps or redoes them (the same bits). Returns
   *  whether they were armed; false with a store that cannot. Not collective. */
  bool prepare_step(const adam_hyper& hyper, const param_groups& groups, int micro_batches, float max_norm = 0.0f) {
    require_final("prepare_step");
    if constexpr (requires { store_.prepare(hyper, groups, micro_batches, max_norm); })
      return store_.prepare(hyper, groups, micro_batches, max_norm);
    else return false;
  }

  /** @brief One Adam(W) step of every part (where the store placed it): gradients averaged over
   *  @p micro_batches — the backward passes of all ranks since the last step (ranks x each rank's
   *  micro-batches), so with each rank's loss a mean over its samples the step sees the mean over
   *  all of them and the loss is not scaled by 1/N too — and clipped to @p max_norm (0: off) by the
   *  global norm, each replica counted once; then the gradients are cleared and the replicas'
   *  working copies refreshed. The learning rate is `hyper.lr`. */
  step_result step(const adam_hyper& hyper, const param_groups& groups, int micro_batches, float max_norm = 0.0f) {
    require_final("step");
    if (comm_.size() > 1)  // before any collective that depends on them: ranks passing other ones stop together
      step_agreement("rtp::sharded_model::step",
                     {{"lr", hyper.lr},
                      {"beta1", hyper.beta1},
                      {"beta2", hyper.beta2},
                      {"eps", hyper.eps},
                      {"weight_decay", hyper.weight_decay},
                      {"micro_batches", static_cast<double>(micro_batches)},
                      {"max_norm", max_norm},
                      {"the step's number", static_cast<double>(store_.step_count() + 1)}},
                     comm_.rank(), comm_.size())
          .run(comm_);
    const auto r = store_.step(hyper, groups, micro_batches, max_norm, [this](double local) {
      if (comm_.size() > 1) comm_.allreduce(std::span<double>(&local, 1), reduce_op::sum);
      return local;
    });
    publish(replica_index_);
    return {r.grad_norm, r.clip_coefficient, r.stepped, r.early_steps, r.early_redone};
  }
  /** @brief What to multiply the loss by before a backward: the store's loss scale (fp16), else 1. */
  [[nodiscard]] float loss_scale() const {
    if constexpr (requires { store_.loss_scale(); }) return store_.loss_scale();
    else return 1.0f;
  }
  /** @brief Drops the accumulated gradients. */
  void zero_grad() {
    require_final("zero_grad");
    store_.zero_grad();
    for (auto& b : replica_g_) ops_.zero(b.p, b.n);
  }
  [[nodiscard]] std::int64_t step_count() const { return store_.step_count(); }
  void restore_step_count(std::int64_t n) { store_.restore_step_count(n); }

  // ---- sleep and wake --------------------------------------------------------------------------

  /** @brief Between passes, frees the compute tier of this model's memory: the transit buffers and
   *  the replicas' working copies and gradient buffers (scratch, copies of the store's weights, and
   *  zeros outside a backward), then puts the store to sleep (`ShardStore::sleep`: a chunk runtime
   *  moves its chunks off the device). Until `wake()`, stages, passes, steps, `zero_grad()` and
   *  `replica()` are refused (`state_error`); `read` and `write` work. Not collective. */
  void sleep() {
    require_final("sleep");
    if (asleep_) throw state_error("rtp::sharded_model::sleep while asleep: call wake() first");
    ops_.settle();
    transit_->release();
    for (auto& b : buffers_) store_.deallocate(std::exchange(b.p, nullptr), b.n);
    for (auto* b : {&wide_w_, &wide_g_})
      if (b->p) store_.deallocate(std::exchange(b->p, nullptr), b->n);
    replica_w_.assign(replica_w_.size(), {});
    replica_g_.assign(replica_g_.size(), {});
    asleep_ = true;
    store_.sleep();  // if it throws, the model is asleep and the store awake: wake() brings both back
  }
  /** @brief Ends a sleep: the store wakes, the buffers are allocated again and the replicas'
   *  working copies loaded. Pointers from `replica()` and `replica_grad()` taken before the sleep
   *  are stale: take them again. A call that throws (no room) may be made again. */
  void wake() {
    if (!asleep_) throw state_error("rtp::sharded_model::wake while awake: call sleep() first");
    if (store_.asleep()) store_.wake();
    transit_->restore();
    for (auto& b : buffers_)
      if (!b.p) b.p = store_.allocate(b.n);
    if constexpr (mixed) take_wide();
    for (std::size_t r = 0; r < replica_index_.size(); ++r)  // take() gave each replica two: weights, gradient
      replica_w_[r] = buffers_[2 * r], replica_g_[r] = buffers_[2 * r + 1];
    asleep_ = false;
    publish(replica_index_);
  }
  [[nodiscard]] bool asleep() const noexcept { return asleep_; }

  // ---- state -----------------------------------------------------------------------------------

  /** @brief Flyweight initialisation: every element this rank holds set to
   *  `value(tensor, global_index)` (a pure function, e.g. a `counter_init`), so every world size
   *  starts from the same model. After `finalize()`, outside passes (it writes every part). */
  void init(const std::function<float(std::size_t, std::size_t)>& value) {
    std::vector<float> v;
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      v.assign(parts_[k].elems, 0.0f);
      parts_[k].for_each([&](std::size_t t, std::size_t i, std::size_t off) { v[off] = value(t, i); });
      write(k, chunk_kind::param, v);
    }
  }
  [[nodiscard]] std::span<const tensor_spec> specs() const noexcept { return specs_; }
  [[nodiscard]] std::span<const model_part> parts() const noexcept { return parts_; }
  /** @brief List @p kind of part @p k, whole, into @p out (outside a pass). */
  void read(std::size_t k, chunk_kind kind, std::span<float> out) const {
    check_size(k, out.size(), "read");
    store_.read(k, kind, out);
  }
  /** @brief Sets list @p kind of part @p k from @p in (outside passes and untraced sections; a
   *  replica alike on every rank, its working copy refreshed). */
  void write(std::size_t k, chunk_kind kind, std::span<const float> in) {
    check_size(k, in.size(), "write");
    store_.write(k, kind, in);
    if (kind == chunk_kind::param && parts_[k].replicated && finalized_ && !asleep_)  // else wake() publishes
      publish(std::span<const std::size_t>(&k, 1));
  }

  [[nodiscard]] int rank() const noexcept { return comm_.rank(); }
  [[nodiscard]] int world() const noexcept { return comm_.size(); }
  [[nodiscard]] Comm& communicator() const noexcept { return comm_; }
  [[nodiscard]] Store& store() const noexcept { return store_; }
  [[nodiscard]] const Ops& ops() const noexcept { return ops_; }
  /** @brief Rotated part @p k's rotation (`state_error` for a replica or before `finalize`). */
  [[nodiscard]] rotation_type& rotation_of(std::size_t k) { return *rotation_ptr(k); }
  [[nodiscard]] const rotation_type& rotation_of(std::size_t k) const { return *rotation_ptr(k); }
  /** @brief The rotations' shifts, bytes and exposed waits, summed. */
  [[nodiscard]] rotation_stats ring_stats() const noexcept {
    rotation_stats s;
    for (const auto& r : rotations_)
      if (r) s.shifts += r->stats().shifts, s.bytes_sent += r->stats().bytes_sent, s.wait_s += r->stats().wait_s;
    return s;
  }
  void reset_ring_stats() noexcept {
    for (auto& r : rotations_)
      if (r) r->reset_stats();
  }
  /** @brief Bytes of the rotations' transit buffers: one set of five shards of the largest. */
  [[nodiscard]] std::size_t transit_bytes() const noexcept { return transit_ ? transit_->bytes() : 0; }
  /** @brief Bytes this object takes from the store's compute tier: the transit buffers and the
   *  replicas' working copies and gradient buffers (the model data is the store's). */
  [[nodiscard]] std::size_t transient_bytes() const noexcept {
    std::size_t n = transit_bytes() + (wide_w_.n + wide_g_.n) * sizeof(float);
    for (const auto& b : buffers_) n += b.n * sizeof(float);
    return n;
  }

 private:
  struct buffer {
    float* p = nullptr;
    std::size_t n = 0;
  };

  std::size_t add(model_part part, bool replicated) {
    if (finalized_) throw state_error("rtp::sharded_model: a part added after finalize(); add every part first");
    part.replicated = replicated;
    if (part.segments.empty() || part.elems == 0)
      throw config_error("rtp::sharded_model: an empty part; build parts with rtp::make_part");
    std::vector<shard_segment> segs;
    for (const auto& s : part.segments) {
      if (s.tensor >= specs_.size())
        throw config_error("rtp::sharded_model: a part names tensor " + std::to_string(s.tensor) +
                           ", which the specs do not have");
      const auto& spec = specs_[s.tensor];
      segs.push_back({replicated ? spec.name : spec.name + "@" + std::to_string(comm_.rank()), s.begin, s.end - s.begin,
                      spec.role});
    }
    const std::size_t k = store_.add_shard(part.elems, std::move(segs), !replicated || comm_.rank() == 0);
    if (k != parts_.size())
      throw state_error("rtp::sharded_model: the store holds buffers of its own; give the model a store of its own");
    parts_.push_back(std::move(part));
    return k;
  }
  /** Floats that hold @p n elements of the shards' type. */
  static std::size_t floats_for(std::size_t n) noexcept {
    return (n * sizeof(element_type) + sizeof(float) - 1) / sizeof(float);
  }
  /** Mixed precision: the float copies of the resident shard and of this rank's gradient term. */
  void take_wide() {
    for (auto* b : {&wide_w_, &wide_g_})
      if (!b->p && widest_ > 0) *b = {store_.allocate(widest_), widest_};
  }
  buffer take(std::size_t n) {
    buffers_.reserve(buffers_.size() + 1);  // no throw between allocate and push_back
    buffers_.push_back({store_.allocate(n), n});
    return buffers_.back();
  }
  rotation_type* rotation_ptr(std::size_t k) const {
    if (!finalized_ || k >= rotations_.size() || !rotations_[k])
      throw state_error("rtp::sharded_model: part " + std::to_string(k) +
                        " is not a rotated part of a finalized model");
    return rotations_[k].get();
  }
  std::size_t slot(std::size_t k) const {
    if (k >= slot_of_.size() || slot_of_[k] == SIZE_MAX)
      throw state_error("rtp::sharded_model: part " + std::to_string(k) + " is not a replica of a finalized model");
    return slot_of_[k];
  }
  void check_size(std::size_t k, std::size_t n, const char* what) const {
    if (k >= parts_.size() || parts_[k].elems != n)
      throw config_error(std::string("rtp::sharded_model::") + what + ": part " + std::to_string(k) + " with " +
                         std::to_string(n) + " elements, but " +
                         (k >= parts_.size() ? "the model has " + std::to_string(parts_.size()) + " parts"
                                             : "it holds " + std::to_string(parts_[k].elems)) +
                         "; size the buffer by parts()[k].elems");
  }
  void require_final(const char* what) const {
    if (!finalized_)
      throw state_error(std::string("rtp::sharded_model::") + what +
                        " before finalize(): register the parts, then finalize");
    if (asleep_) throw state_error(std::string("rtp::sharded_model::") + what + " while asleep: call wake() first");
  }
  /** Replicas @p parts' working copies from their weights in the store, one stage each (untraced:
   *  not a stage of the model's iteration). */
  void publish(std::span<const std::size_t> parts) {
    if (parts.empty()) return;
    [[maybe_unused]] auto guard = store_.untraced();
    for (const std::size_t& k : parts)
      store_.stage("replicas", false, std::span<const std::size_t>(&k, 1),
                   [&] { store_.load(k, std::span<float>(replica_w_[slot(k)].p, replica_w_[slot(k)].n)); });
    ops_.settle();
  }

  Comm& comm_;
  Store& store_;
  std::vector<tensor_spec> specs_;
  Ops ops_;
  std::vector<model_part> parts_;
  std::unique_ptr<transit_buffers<element_type>> transit_;
  buffer wide_w_, wide_g_;  // mixed precision: the resident shard and the kernel's gradient, as float
  std::size_t widest_ = 0;  // the largest rotated part
  std::vector<std::unique_ptr<rotation_type>> rotations_;  // by part; null for a replica
  std::vector<buffer> buffers_;                            // every compute-tier buffer this object took
  std::vector<buffer> replica_w_, replica_g_;              // by replica: working copy, this backward's gradient
  std::vector<std::size_t> replica_index_;                 // the replicas' part indices
  std::vector<std::size_t> slot_of_;                       // by part: its replica slot, SIZE_MAX for a rotated part
  bool finalized_ = false;
  bool asleep_ = false;
};

}  // namespace chunkstar::rtp
