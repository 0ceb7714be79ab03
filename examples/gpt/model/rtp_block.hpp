// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `gpt::rtp_block`: one GPT transformer block under Rotated Tensor Parallelism (RTP) on
 *         N ranks, and `gpt::rtp_block_partition`, which of the block's weights each shard holds.
 *
 *  Every rank trains on its own micro-batch (as in data parallelism) and owns 1/N of the block's
 *  large weights; the shards rotate round the ring (`chunkstar::rtp::rotation`, one per
 *  sub-layer), activations never move. The partition is "column then row, fused per shard":
 *
 *  - attention, by head group: shard j holds heads [j H/N, (j+1) H/N), i.e. channels
 *    [j C/N, (j+1) C/N) of q, k and v: those rows of the qkv weight and bias, and the same
 *    columns (inputs) of the output projection. With the shard at hand a rank computes q, k, v of
 *    those heads, their attention, and the heads' partial output projection [rows, C], which it
 *    adds to a running sum; after the N steps the sum is the full projection.
 *  - MLP, by hidden unit: shard j holds units [j 4C/N, (j+1) 4C/N): those rows of the fc weight and
 *    bias and the same columns of the fc projection. fc, GELU (element-wise, so local to the units)
 *    and the partial projection happen in one step; the partial outputs are summed likewise.
 *  - replicated on every rank: both LayerNorms' gains and biases and the two output biases
 *    (added once, after the sum, not per shard). Their gradients are summed over ranks by
 *    `reduce_replicated_grads`, so the replicas stay equal.
 *
 *  The math is the serial block's (gpt_model.hpp `block_forward` / `block_backward`), written with
 *  the same kernels (kernels_cpu.hpp) on sub-blocks: a shard's q|k|v rows form a qkv weight for
 *  H/N heads of width C/N, so `attention_forward` runs unchanged on the head subset. Activations use
 *  `block_activations` with the serial block's sizes (RTP does not shrink activations); only the
 *  inner layout of the per-shard tensors differs (see `rtp_block::forward`). docs/rtp.md has the
 *  memory and communication per rank and why this split.
 *
 *  The kernels run on a `LayerBackend` (gpt_backend.hpp): the CPU kernels by default, the CUDA ones
 *  with `cuda_backend`, where activations, replicas, transit buffers and the loaded shards are
 *  device memory and the rotations' buffer operations are queued on the backend's stream
 *  (`backend_buffer_ops`; a rotation settles the stream before each shift).
 */
#pragma once

#include "gpt_backend.hpp"
#include "gpt_model.hpp"
#include "kernels_cpu.hpp"
#include "model_config.hpp"

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/rtp/buffer_ops.hpp>
#include <chunkstar/rtp/partition.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/rotation.hpp>
#include <chunkstar/rtp/weight_pair.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpt {

/** @brief A rotation's buffer operations on a backend's compute tier (rtp/buffer_ops.hpp): fills,
 *  sums and copies queued on the backend's stream; `settle` waits for the stream. Also a chunk
 *  shard store's ops (rtp/chunk_shard_store.hpp `ShardOps`: its scopes close with `stream()`). */
template <LayerBackend Backend>
struct backend_buffer_ops {
  static constexpr bool host_memory = Backend::host_memory;
  Backend* backend = nullptr;
  void zero(float* p, std::size_t n) const { backend->zero(p, n); }
  void add(float* acc, const float* x, std::size_t n) const { backend->add(acc, x, n); }
  void copy(float* dst, const float* src, std::size_t n) const { backend->copy(dst, src, n); }
  void settle() const { backend->quiesce(); }
  [[nodiscard]] auto stream() const { return backend->stream(); }

  // 16-bit shards (RTP in bf16 or fp16). On a backend whose memory is the host's these are the
  // host loops; a device backend has no 16-bit kernels for them yet, and the trainer refuses RTP
  // in 16-bit there before anything runs (rtp_session), so reaching one is a state_error.
  template <class U>
  requires(!std::is_same_v<U, float>) void zero(U* p, std::size_t n) const { host_16bit("zero").zero(p, n); }
  template <class U>
  requires(!std::is_same_v<U, float>) void add(U* acc, const U* x, std::size_t n) const {
    host_16bit("add").add(acc, x, n);
  }
  template <class U>
  requires(!std::is_same_v<U, float>) void copy(U* dst, const U* src, std::size_t n) const {
    host_16bit("copy").copy(dst, src, n);
  }
  template <class U>
  void widen(float* dst, const U* src, std::size_t n) const {
    backend->widen(reinterpret_cast<const std::byte*>(src), chunkstar::dtype_of_v<U>, dst, n);
  }
  template <class U>
  void narrow(U* dst, const float* src, std::size_t n) const {
    zero(dst, n);
    accumulate(dst, src, n);
  }
  template <class U>
  void accumulate(U* acc, const float* x, std::size_t n) const {
    backend->add_into(reinterpret_cast<std::byte*>(acc), chunkstar::dtype_of_v<U>, x, n);
  }

 private:
  static chunkstar::rtp::host_buffer_ops<float> host_16bit(const char* what) {
    if constexpr (!Backend::host_memory)
      throw chunkstar::state_error(std::string("gpt::backend_buffer_ops: 16-bit ") + what +
                                   " on a device backend, which has no 16-bit kernel for it: RTP in 16-bit runs on "
                                   "the CPU backend");
    return {};
  }
};

/** @brief @p n floats of a backend's compute-tier memory, zeroed; freed with it. Move-only. */
template <LayerBackend Backend>
class compute_buffer {
 public:
  compute_buffer() = default;
  compute_buffer(Backend& b, std::size_t n) : b_(&b), n_(n), p_(n ? backend_tier<Backend>{&b}.allocate(n) : nullptr) {}
  compute_buffer(compute_buffer&& o) noexcept
      : b_(std::exchange(o.b_, nullptr)), n_(std::exchange(o.n_, 0)), p_(std::exchange(o.p_, nullptr)) {}
  compute_buffer& operator=(compute_buffer&& o) noexcept {
    if (this != &o) {
      release();
      b_ = std::exchange(o.b_, nullptr), n_ = std::exchange(o.n_, 0), p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  ~compute_buffer() { release(); }
  [[nodiscard]] float* data() const noexcept { return p_; }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] std::span<float> span() const noexcept { return {p_, n_}; }

 private:
  void release() noexcept {
    if (!p_) return;
    b_->quiesce();  // no kernel may still use it
    b_->deallocate(p_, n_);
    p_ = nullptr;
  }
  Backend* b_ = nullptr;
  std::size_t n_ = 0;
  float* p_ = nullptr;
};

/** @brief The tensors of one block, in `block_params` order. */
enum class block_tensor : int {
  ln1_w,
  ln1_b,
  qkv_w,
  qkv_b,
  proj_w,
  proj_b,
  ln2_w,
  ln2_b,
  fc_w,
  fc_b,
  fcproj_w,
  fcproj_b
};

/** @brief Number of `block_tensor`s. */
inline constexpr std::size_t block_tensor_count = 12;

/** @brief The tensor @p t of @p p. */
template <cpu::scalar T>
T* tensor_of(const block_params<T>& p, block_tensor t) noexcept {
  T* const all[block_tensor_count] = {p.ln1_w, p.ln1_b, p.qkv_w, p.qkv_b, p.proj_w,   p.proj_b,
                                      p.ln2_w, p.ln2_b, p.fc_w,  p.fc_b,  p.fcproj_w, p.fcproj_b};
  return all[static_cast<std::size_t>(t)];
}

/** @brief Elements of tensor @p t in a block of width @p C. */
constexpr std::size_t block_tensor_elems(block_tensor t, std::size_t C) noexcept {
  switch (t) {
    case block_tensor::qkv_w: return 3 * C * C;
    case block_tensor::qkv_b: return 3 * C;
    case block_tensor::proj_w: return C * C;
    case block_tensor::fc_w: return 4 * C * C;
    case block_tensor::fc_b: return 4 * C;
    case block_tensor::fcproj_w: return 4 * C * C;
    default: return C;  // the LayerNorms and the two output biases
  }
}

/** @brief Which elements of a block each of N shards holds, and where in the shard buffer.
 *
 *  A pure description (no communication); `partition_block` builds it and checks divisibility.
 *  Both sharded halves are `chunkstar::rtp::weight_pair`s (rtp/weight_pair.hpp), row-major,
 *  Cs = C/N channels (H/N heads), M = 4C/N hidden units:
 *  - attention shard: [q rows | k rows | v rows] of qkv.w (3 Cs x C) | the same rows of qkv.b
 *    (3 Cs) | proj.w's columns (C x Cs): the pair qkv (3 blocks of C rows) then proj. The q|k|v
 *    order per row is what `attention_forward` expects of a qkv tensor of width Cs, so the shard
 *    is a self-contained Cs-wide attention.
 *  - MLP shard: fc.w's rows (M x C) | fc.b's (M) | fcproj.w's columns (C x M): the pair fc then fcproj.
 *  - replicated (every rank): ln1.w | ln1.b | proj.b | ln2.w | ln2.b | fcproj.b, C each.
 */
struct rtp_block_partition {
  std::size_t width = 0;                  ///< C
  std::size_t heads = 0;                  ///< H
  std::size_t world = 0;                  ///< N
  std::size_t head_size = 0;              ///< C / H
  std::size_t shard_heads = 0;            ///< H / N
  std::size_t shard_channels = 0;         ///< Cs = C / N = shard_heads * head_size
  std::size_t shard_units = 0;            ///< M = 4C / N
  chunkstar::rtp::weight_pair attention;  ///< qkv (3 blocks of C rows, biased) then proj
  chunkstar::rtp::weight_pair mlp;        ///< fc (4C rows, biased) then fcproj

  /** @brief The replicated tensors, in their order in the replicated buffer. */
  static constexpr std::array<block_tensor, 6> replicated_tensors{block_tensor::ln1_w,  block_tensor::ln1_b,
                                                                  block_tensor::proj_b, block_tensor::ln2_w,
                                                                  block_tensor::ln2_b,  block_tensor::fcproj_b};

  [[nodiscard]] constexpr std::size_t attn_qkv_w() const noexcept { return attention.a_weight_offset(); }
  [[nodiscard]] constexpr std::size_t attn_qkv_b() const noexcept { return attention.a_bias_offset(); }
  [[nodiscard]] constexpr std::size_t attn_proj_w() const noexcept { return attention.b_weight_offset(); }
  /** @brief Elements of an attention shard: Cs (4C + 3). */
  [[nodiscard]] constexpr std::size_t attn_elems() const noexcept { return attention.shard_elems(); }

  [[nodiscard]] constexpr std::size_t mlp_fc_w() const noexcept { return mlp.a_weight_offset(); }
  [[nodiscard]] constexpr std::size_t mlp_fc_b() const noexcept { return mlp.a_bias_offset(); }
  [[nodiscard]] constexpr std::size_t mlp_proj_w() const noexcept { return mlp.b_weight_offset(); }
  /** @brief Elements of an MLP shard: M (2C + 1). */
  [[nodiscard]] constexpr std::size_t mlp_elems() const noexcept { return mlp.shard_elems(); }

  /** @brief Elements of the replicated buffer: 6C. */
  [[nodiscard]] constexpr std::size_t replicated_elems() const noexcept { return 6 * width; }
  /** @brief Offset of replicated tensor @p t (one of `replicated_tensors`) in the replicated buffer. */
  [[nodiscard]] constexpr std::size_t replicated_offset(block_tensor t) const noexcept {
    for (std::size_t k = 0; k < replicated_tensors.size(); ++k)
      if (replicated_tensors[k] == t) return k * width;
    return replicated_elems();  // not replicated
  }

  /** @brief Calls `f(tensor, global_index, offset)` for every element of attention shard @p shard:
   *  element `global_index` of the full `tensor` lives at `offset` in the shard. */
  template <class F>
  void for_each_attention(int shard, F&& f) const {
    using part = chunkstar::rtp::weight_pair::part;
    attention.for_each(static_cast<std::size_t>(shard), [&](part p, std::size_t i, std::size_t at) {
      f(p == part::a_weight ? block_tensor::qkv_w
        : p == part::a_bias ? block_tensor::qkv_b
                            : block_tensor::proj_w,
        i, at);
    });
  }

  /** @brief The same for MLP shard @p shard. */
  template <class F>
  void for_each_mlp(int shard, F&& f) const {
    using part = chunkstar::rtp::weight_pair::part;
    mlp.for_each(static_cast<std::size_t>(shard), [&](part p, std::size_t i, std::size_t at) {
      f(p == part::a_weight ? block_tensor::fc_w
        : p == part::a_bias ? block_tensor::fc_b
                            : block_tensor::fcproj_w,
        i, at);
    });
  }

  /** @brief The same for the replicated buffer. */
  template <class F>
  void for_each_replicated(F&& f) const {
    for (std::size_t k = 0; k < replicated_tensors.size(); ++k)
      for (std::size_t i = 0; i < width; ++i) f(replicated_tensors[k], i, k * width + i);
  }
};

/** @brief The partition of a block of @p c over @p world ranks. Throws `chunkstar::config_error`
 *  (from rtp/partition.hpp, naming the dimension and listing the world sizes that divide it) when
 *  @p world does not divide the heads, or the MLP's 4C hidden units. (4C = 4 H (C/H), so any N
 *  that divides the heads divides 4C: the heads are the binding dimension.) */
inline rtp_block_partition partition_block(const gpt_config& c, int world) {
  validate(c);
  const auto H = static_cast<std::size_t>(c.heads), C = static_cast<std::size_t>(c.width);
  chunkstar::rtp::require_divisible("heads", H, world);
  rtp_block_partition p;
  p.width = C;
  p.heads = H;
  p.world = static_cast<std::size_t>(world);
  p.head_size = C / H;
  p.shard_heads = chunkstar::rtp::shard_range(H, world, 0, "heads").size();
  p.shard_channels = p.shard_heads * p.head_size;
  // Whole heads per shard (checked above), so the C channels split too.
  p.attention = chunkstar::rtp::make_weight_pair(C, C, C, world, "attention channels (width)", 3);
  p.mlp = chunkstar::rtp::make_weight_pair(C, 4 * C, C, world, "mlp hidden units (4 * width)");
  p.shard_units = p.mlp.shard_units();
  return p;
}

/** @brief One transformer block of config @p c on the ranks of a `Communicator`, under RTP.
 *
 *  Every rank of `comm` constructs one (same config), fills its shards (`fill` by global index, so
 *  a rank materialises only its own; or `load` from full tensors), then calls `forward` and
 *  `backward` in the same sequence (they are collectives: ring shifts and, in backward, one
 *  all-reduce of the replicated gradients). Each rank passes its own micro-batch.
 *
 *  Holds per rank: the owned attention and MLP shards and their gradients (two
 *  `chunkstar::rtp::rotation`s, each with its transit buffers) and the replicated tensors and
 *  their gradients.
 *
 *  **Gradients.** `backward` *replaces* the owned shards' gradients with the gradient of the
 *  **sum** of the ranks' losses (what the rotation gives) and the replicated gradients with the
 *  same sum (all-reduced). Scale the upstream gradient for a mean.
 *
 *  **Exception safety.** If a kernel or the communicator throws, the owned weights and the
 *  replicated weights are unchanged (nothing here writes them), no shift is in flight (the
 *  rotations' guarantee), and the object can be used again; activations, the workspace and the
 *  gradients are unspecified (a failed backward may have replaced the MLP shard's gradient and not
 *  the attention shard's). A failure on one rank reaches the peers as `communication_error` (see
 *  rtp/rotation.hpp).
 */
template <chunkstar::Communicator Comm, LayerBackend Backend = cpu_backend>
class rtp_block {
 public:
  using backend_type = Backend;
  using rotation_type = chunkstar::rtp::rotation<Comm, float, backend_buffer_ops<Backend>>;

  /** @brief Partitions a block of @p c over `comm.size()` ranks (`config_error` if the world size
   *  does not divide the heads) and allocates this rank's shards, zeroed, and the two rotations'
   *  transit buffers, in host memory: the CPU kernels. */
  rtp_block(Comm& comm, const gpt_config& c) requires(Backend::host_memory&& std::default_initializable<Backend>)
      : comm_(comm),
        config_(c),
        part_(partition_block(c, comm.size())),
        b_(&local_),
        own_attn_(std::in_place, comm, part_.attn_elems(), backend_buffer_ops<Backend>{b_}),
        own_mlp_(std::in_place, comm, part_.mlp_elems(), backend_buffer_ops<Backend>{b_}),
        attn_(&*own_attn_),
        mlp_(&*own_mlp_),
        rep_(*b_, part_.replicated_elems()),
        rep_grad_(*b_, part_.replicated_elems()),
        rep_p_(rep_.data()),
        rep_grad_p_(rep_grad_.data()) {}

  /** @brief A block on a model's state (`chunkstar::rtp::sharded_model`): its two rotations
   *  @p attn and @p mlp (built with `external_shard` by the model; `forward` and `backward` then
   *  take a pass that runs them through the model, which loads the shards from its store and adds
   *  their gradients there), and its replicas' working copy
   *  @p replicas and gradient buffer @p replica_grads (6C floats each, compute-tier memory of the
   *  model's): `backward` adds into the buffer and leaves the sum over the ranks to the model
   *  (`sharded_model::reduce_replica_grads`). Everything is held by reference. */
  template <class Rotation>
  rtp_block(Comm& comm, const gpt_config& c, Rotation& attn, Rotation& mlp, const float* replicas, float* replica_grads,
            Backend* backend = nullptr)
      : comm_(comm),
        config_(c),
        part_(partition_block(c, comm.size())),
        b_(backend ? backend : &local_),
        attn_(as_own_type(attn)),  // a 16-bit model's rotations are not this type: only their passes are used
        mlp_(as_own_type(mlp)),
        rep_p_(
            const_cast<float*>(replicas)),  // written only through write_replicated, which a model's block does not use
        rep_grad_p_(replica_grads),
        model_replicas_(true) {
    if (attn.shard_elems() != part_.attn_elems() || mlp.shard_elems() != part_.mlp_elems())
      throw chunkstar::config_error("gpt::rtp_block: the model's rotations are not this block's shards (" +
                                    std::to_string(attn.shard_elems()) + " and " + std::to_string(mlp.shard_elems()) +
                                    " elements, expected " + std::to_string(part_.attn_elems()) + " and " +
                                    std::to_string(part_.mlp_elems()) + ")");
  }

  rtp_block(const rtp_block&) = delete;
  rtp_block& operator=(const rtp_block&) = delete;

  /** @brief On a model's state: its replicas' buffers moved (the model woke from a sleep). */
  void rebind_replicas(const float* replicas, float* replica_grads) {
    if (!model_replicas_)
      throw chunkstar::state_error("gpt::rtp_block::rebind_replicas: this block holds its own replicas");
    rep_p_ = const_cast<float*>(replicas);  // as the constructor's
    rep_grad_p_ = replica_grads;
  }

  [[nodiscard]] const rtp_block_partition& partition() const noexcept { return part_; }
  [[nodiscard]] const gpt_config& config() const noexcept { return config_; }
  /** @brief The attention sub-layer's rotation: `owned()` is this rank's attention shard. */
  [[nodiscard]] rotation_type& attention() noexcept { return *own_rotation(attn_); }
  [[nodiscard]] const rotation_type& attention() const noexcept { return *own_rotation(attn_); }
  /** @brief The MLP sub-layer's rotation. */
  [[nodiscard]] rotation_type& mlp() noexcept { return *own_rotation(mlp_); }
  [[nodiscard]] const rotation_type& mlp() const noexcept { return *own_rotation(mlp_); }
  /** @brief The replicated tensors (`rtp_block_partition::replicated_tensors` order), the same on
   *  every rank as long as every rank applies the same update to them. Compute-tier memory (the
   *  host's with the CPU backend; otherwise use `write_replicated` and `read_replicated`). */
  [[nodiscard]] std::span<float> replicated() noexcept { return {rep_p_, part_.replicated_elems()}; }
  [[nodiscard]] std::span<const float> replicated() const noexcept { return {rep_p_, part_.replicated_elems()}; }
  /** @brief Their gradients, summed over the ranks by the last `backward`. */
  [[nodiscard]] std::span<float> replicated_grad() noexcept { return {rep_grad_p_, part_.replicated_elems()}; }
  [[nodiscard]] std::span<const float> replicated_grad() const noexcept {
    return {rep_grad_p_, part_.replicated_elems()};
  }
  /** @brief Copies host values @p in (`replicated().size()` of them) into the replicas. */
  void write_replicated(std::span<const float> in) {
    require_replicated_size(in.size(), "write_replicated");
    if (model_replicas_)
      throw chunkstar::state_error(
          "gpt::rtp_block::write_replicated: the replicas are the model's; write them through the model");
    b_->to_compute(rep_p_, in.data(), in.size_bytes());
  }
  /** @brief Copies the replicas (@p grad false) or their gradients into host memory @p out;
   *  returns once the bytes are there (after the kernels that wrote them). */
  void read_replicated(std::span<float> out, bool grad = false) const {
    require_replicated_size(out.size(), "read_replicated");
    b_->from_compute(out.data(), grad ? rep_grad_p_ : rep_p_, out.size_bytes());
  }
  /** @brief The backend the kernels run on. */
  [[nodiscard]] Backend& backend() const noexcept { return *b_; }

  /** @brief Bytes per rank of model data: owned shards and their gradients, replicas and theirs. */
  [[nodiscard]] std::size_t model_bytes() const noexcept {
    return 2 * (part_.attn_elems() + part_.mlp_elems() + part_.replicated_elems()) * sizeof(float);
  }
  /** @brief Bytes per rank the rotations add (their transit buffers; shared ones are the model's to count). */
  [[nodiscard]] std::size_t transient_bytes() const noexcept {
    return attn_ && mlp_ ? attn_->transient_bytes() + mlp_->transient_bytes() : 0;
  }

  /** @brief Materialises this rank's shards and the replicas only: element i of tensor t is
   *  `value(t, i)` (i the index in the full tensor; e.g. a `counter_init` draw). */
  template <class F>
  void fill(F&& value) requires(Backend::host_memory) {
    const int me = comm_.rank();
    auto a = attn_->owned();
    part_.for_each_attention(me, [&](block_tensor t, std::size_t i, std::size_t off) { a[off] = value(t, i); });
    auto m = mlp_->owned();
    part_.for_each_mlp(me, [&](block_tensor t, std::size_t i, std::size_t off) { m[off] = value(t, i); });
    auto r = replicated();
    part_.for_each_replicated([&](block_tensor t, std::size_t i, std::size_t off) { r[off] = value(t, i); });
  }

  /** @brief `fill` from the full tensors of @p full. */
  void load(const block_params<float>& full) requires(Backend::host_memory) {
    fill([&](block_tensor t, std::size_t i) { return tensor_of(full, t)[i]; });
  }

  /** @brief Writes this rank's shards and the replicas into their places in the full tensors of
   *  @p full (the other shards' elements are left alone): every rank storing into one block
   *  assembles the whole block. */
  void store(const block_params<float>& full) const requires(Backend::host_memory) {
    store_from(full, attn_->owned(), mlp_->owned(), replicated());
  }
  /** @brief The same for the gradients. */
  void store_grads(const block_params<float>& full) const requires(Backend::host_memory) {
    store_from(full, attn_->owned_grad(), mlp_->owned_grad(), replicated_grad());
  }

  /** @brief The block's forward on this rank's micro-batch of @p B sequences of @p Tn tokens:
   *  `a.res3` = block(@p x), as `block_forward`; @p proj is [B Tn, C] scratch. Two rotations (N - 1
   *  shifts each); forward-only use (evaluation) leaves every shard where it was.
   *
   *  Activations: the same tensors and sizes as the serial block (`bind_block_activations`), with
   *  the per-shard ones stored shard-major: shard j's q|k|v [rows, 3 Cs] at `a.qkv + j rows 3 Cs`,
   *  its heads' output [rows, Cs] at `a.atty + j rows Cs`, their probabilities [B, H/N, Tn, Tn] at
   *  `a.att + j B (H/N) Tn Tn`, and MLP shard j's fc output and GELU [rows, M] at
   *  `a.fch + j rows M` and `a.fch_gelu + j rows M`. The others (LayerNorms, res2, res3) are the
   *  serial layout. All buffers are compute-tier memory; on a device backend the
   *  kernels may still run when it returns (quiesce the backend before reading `a.res3`).
   *  @p attention_scratch: `Backend::attention_scratch_elems(B, Tn, Cs, H/N)` floats a model's
   *  blocks may share (they run one at a time); without it the block keeps its own. */
  void forward(std::size_t B, std::size_t Tn, const float* x, const block_activations<float>& a, float* proj,
               float* attention_scratch = nullptr) {
    forward(B, Tn, x, a, proj, own_pass(), attention_scratch);
  }
  /** @brief The same on a model's state: `pass(which, f)` runs rotation @p which's (0 attention,
   *  1 MLP) forward with `f`, e.g. `model.forward(first_part + which, f)`. */
  template <class Pass>
  requires(!std::convertible_to<Pass, float*>) void forward(std::size_t B, std::size_t Tn, const float* x,
                                                            const block_activations<float>& a, float* proj, Pass&& pass,
                                                            float* attention_scratch = nullptr) {
    compute_activation_sizes(config_, B, Tn);  // validates the shape
    const std::size_t N = B * Tn, C = part_.width, Cs = part_.shard_channels, M = part_.shard_units;
    const std::size_t G = part_.shard_heads;
    Backend& b = *b_;
    float* const scratch = attention_scratch ? attention_scratch : own_scratch(B, Tn);
    b.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, rep(block_tensor::ln1_w), rep(block_tensor::ln1_b), N, C);
    // res2 first collects the head groups' partial projections, in ring order.
    b.zero(a.res2, N * C);
    pass(0, [&](int j, std::span<const float> s) {
      const auto jj = static_cast<std::size_t>(j);
      float* qkv = a.qkv + jj * N * 3 * Cs;
      float* atty = a.atty + jj * N * Cs;
      float* att = a.att + jj * B * G * Tn * Tn;
      b.matmul_forward(qkv, a.ln1, s.data() + part_.attn_qkv_w(), s.data() + part_.attn_qkv_b(), N, C, 3 * Cs);
      b.attention_forward(atty, att, qkv, B, Tn, Cs, G, scratch);
      b.matmul_forward(proj, atty, s.data() + part_.attn_proj_w(), nullptr, N, Cs, C);
      b.add(a.res2, proj, N * C);
    });
    b.bias_residual(a.res2, x, rep(block_tensor::proj_b), N, C);  // res2 = x + (sum + proj.b)
    b.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, rep(block_tensor::ln2_w), rep(block_tensor::ln2_b), N,
                        C);
    b.zero(a.res3, N * C);
    pass(1, [&](int j, std::span<const float> s) {
      const auto jj = static_cast<std::size_t>(j);
      float* fch = a.fch + jj * N * M;
      float* fch_gelu = a.fch_gelu + jj * N * M;
      b.matmul_forward(fch, a.ln2, s.data() + part_.mlp_fc_w(), s.data() + part_.mlp_fc_b(), N, C, M);
      b.gelu_forward(fch_gelu, fch, N * M);
      b.matmul_forward(proj, fch_gelu, s.data() + part_.mlp_proj_w(), nullptr, N, M, C);
      b.add(a.res3, proj, N * C);
    });
    b.bias_residual(a.res3, a.res2, rep(block_tensor::fcproj_b), N, C);  // res3 = res2 + (sum + fcproj.b)
  }

  /** @brief The block's backward on this rank's micro-batch, for the last `forward` on @p a. On
   *  entry `w.dres` is the gradient of the block's output; on exit, of its input @p x (the sum
   *  over the shards of their contributions, as the serial block's). Replaces the shards' and the
   *  replicas' gradients with their sums over the ranks. Uses of the workspace: dres, dln, and the
   *  first rows*Cs, rows*3Cs, rows*M and rows*M elements of datty, dqkv, dfch_gelu and dfch
   *  (attention's scratch is the block's own, sized by the backend). The shards' gradient sums
   *  replace the rotations' `owned_grad()` (on a model's state, the pass hands them to the model). */
  void backward(std::size_t B, std::size_t Tn, const float* x, const block_activations<float>& a,
                const backward_workspace<float>& w, float* attention_scratch = nullptr) {
    backward(B, Tn, x, a, w, own_pass(), attention_scratch);
  }
  /** @brief The same on a model's state: `pass(which, g)` runs rotation @p which's backward with
   *  `g`, e.g. `model.backward(first_part + which, g)` (which adds the gradient sums to the store). */
  template <class Pass>
  requires(!std::convertible_to<Pass, float*>) void backward(std::size_t B, std::size_t Tn, const float* x,
                                                             const block_activations<float>& a,
                                                             const backward_workspace<float>& w, Pass&& pass,
                                                             float* attention_scratch = nullptr) {
    compute_activation_sizes(config_, B, Tn);
    const std::size_t N = B * Tn, C = part_.width, Cs = part_.shard_channels, M = part_.shard_units;
    const std::size_t G = part_.shard_heads;
    Backend& b = *b_;
    float* const scratch = attention_scratch ? attention_scratch : own_scratch(B, Tn);
    b.zero(rep_grad_p_, part_.replicated_elems());
    // MLP branch: every shard adds its units' share into dln.
    b.add_column_sums(rep_grad(block_tensor::fcproj_b), w.dres, N, C);
    b.zero(w.dln, N * C);
    pass(1, [&](int j, std::span<const float> s, std::span<float> g) {
      const auto jj = static_cast<std::size_t>(j);
      const float* fch = a.fch + jj * N * M;
      const float* fch_gelu = a.fch_gelu + jj * N * M;
      b.zero(w.dfch_gelu, N * M);
      b.matmul_backward(w.dfch_gelu, g.data() + part_.mlp_proj_w(), nullptr, w.dres, fch_gelu,
                        s.data() + part_.mlp_proj_w(), N, M, C);
      b.zero(w.dfch, N * M);
      b.gelu_backward(w.dfch, fch, w.dfch_gelu, N * M);
      b.matmul_backward(w.dln, g.data() + part_.mlp_fc_w(), g.data() + part_.mlp_fc_b(), w.dfch, a.ln2,
                        s.data() + part_.mlp_fc_w(), N, C, M);
    });
    b.layernorm_backward(w.dres, rep_grad(block_tensor::ln2_w), rep_grad(block_tensor::ln2_b), w.dln, a.res2,
                         rep(block_tensor::ln2_w), a.ln2_mean, a.ln2_rstd, N, C);
    // Attention branch: every head group adds its share into dln.
    b.add_column_sums(rep_grad(block_tensor::proj_b), w.dres, N, C);
    b.zero(w.dln, N * C);
    pass(0, [&](int j, std::span<const float> s, std::span<float> g) {
      const auto jj = static_cast<std::size_t>(j);
      const float* qkv = a.qkv + jj * N * 3 * Cs;
      const float* atty = a.atty + jj * N * Cs;
      const float* att = a.att + jj * B * G * Tn * Tn;
      b.zero(w.datty, N * Cs);
      b.matmul_backward(w.datty, g.data() + part_.attn_proj_w(), nullptr, w.dres, atty, s.data() + part_.attn_proj_w(),
                        N, Cs, C);
      b.zero(w.dqkv, N * 3 * Cs);
      b.attention_backward(w.dqkv, w.datty, qkv, att, B, Tn, Cs, G, scratch);
      b.matmul_backward(w.dln, g.data() + part_.attn_qkv_w(), g.data() + part_.attn_qkv_b(), w.dqkv, a.ln1,
                        s.data() + part_.attn_qkv_w(), N, C, 3 * Cs);
    });
    b.layernorm_backward(w.dres, rep_grad(block_tensor::ln1_w), rep_grad(block_tensor::ln1_b), w.dln, x,
                         rep(block_tensor::ln1_w), a.ln1_mean, a.ln1_rstd, N, C);
    if (model_replicas_) return;  // the model sums them with its other replicas'
    b.quiesce();                  // the all-reduce reads the replicas' gradients the kernels wrote
    chunkstar::rtp::reduce_replicated_grads(comm_, replicated_grad());
  }

 private:
  /** The passes of a block that holds its shards: rotation `which` on the shard it owns (a
   *  forward's `f(j, shard)`, a backward's `g(j, shard, grad)`). */
  auto own_pass() {
    if (model_replicas_)
      throw chunkstar::state_error(
          "gpt::rtp_block: a block on a model's state runs its rotations through the model: give forward and backward "
          "a pass");
    return [this](int which, auto&& f) {
      rotation_type& r = which == 0 ? *attn_ : *mlp_;
      if constexpr (std::is_invocable_v<decltype(f), int, std::span<const float>>) r.forward(f);
      else r.backward(f);
    };
  }

  const float* rep(block_tensor t) const noexcept { return rep_p_ + part_.replicated_offset(t); }
  float* rep_grad(block_tensor t) noexcept { return rep_grad_p_ + part_.replicated_offset(t); }

  /** Attention's scratch for micro-batches of B x Tn on the shard's heads, kept between passes. */
  float* own_scratch(std::size_t B, std::size_t Tn) {
    const std::size_t n = Backend::attention_scratch_elems(B, Tn, part_.shard_channels, part_.shard_heads);
    if (scratch_.size() < n) scratch_ = compute_buffer<Backend>(*b_, n);
    return scratch_.data();
  }
  void require_replicated_size(std::size_t n, const char* what) const {
    if (n != part_.replicated_elems())
      throw chunkstar::config_error("gpt::rtp_block::" + std::string(what) + ": " + std::to_string(n) +
                                    " elements given; the replicated tensors hold " +
                                    std::to_string(part_.replicated_elems()) +
                                    " (6 x width): pass a buffer of replicated().size()");
  }

  void store_from(const block_params<float>& full, std::span<const float> a, std::span<const float> m,
                  std::span<const float> r) const {
    const int me = comm_.rank();
    part_.for_each_attention(me,
                             [&](block_tensor t, std::size_t i, std::size_t off) { tensor_of(full, t)[i] = a[off]; });
    part_.for_each_mlp(me, [&](block_tensor t, std::size_t i, std::size_t off) { tensor_of(full, t)[i] = m[off]; });
    part_.for_each_replicated([&](block_tensor t, std::size_t i, std::size_t off) { tensor_of(full, t)[i] = r[off]; });
  }

  template <class Rotation>
  static rotation_type* as_own_type(Rotation& r) noexcept {
    if constexpr (std::is_same_v<Rotation, rotation_type>) return &r;
    else return nullptr;
  }
  static rotation_type* own_rotation(rotation_type* r) {
    if (!r)
      throw chunkstar::state_error(
          "gpt::rtp_block: this block runs on a 16-bit model's rotations, which its model holds: ask the model");
    return r;
  }

  Comm& comm_;
  gpt_config config_;
  rtp_block_partition part_;
  Backend local_{};  // the kernels, when the caller gives no backend
  Backend* b_;
  std::optional<rotation_type> own_attn_, own_mlp_;  // none on a model's state
  rotation_type* attn_;
  rotation_type* mlp_;
  compute_buffer<Backend> rep_, rep_grad_, scratch_;  // the replicas' own buffers, empty on a model's state
  float* rep_p_;
  float* rep_grad_p_;
  bool model_replicas_ = false;
};

}  // namespace gpt
