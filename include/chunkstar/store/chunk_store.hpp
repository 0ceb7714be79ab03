// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_store`: the chunks themselves — one slot per chunk of every list, its payload, the
 *         tier it lives in, the copy in flight into it, its pins — and the mechanics that change
 *         them: allocate, move, zero-fill, release, wait, retire the buffers finished copies read.
 *         It decides nothing: what moves where, and when, is the caller's choice.
 *
 *  Every operation gives the strong guarantee on the logical state (tier, payload, residency
 *  counters): it changes it after its last call that can throw, so after a throw the chunk is where
 *  it was. Decisions read only that logical state, never whether a copy happens to have finished,
 *  so they are deterministic. The destructor waits for every copy and never throws.
 *
 *  What is not moves, pins and slots lives beside it, built on these mechanics: a tier below the
 *  host joins move() through `lower_tier` (the disk: disk_moves.hpp); values across dtypes are
 *  `chunk_values`; ZeRO's group buffers are zero/group_buffers.hpp, on the unslotted buffers here.
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/platform.hpp>
#include <chunkstar/observe/runtime_stats.hpp>
#include <chunkstar/store/chunk_pins.hpp>
#include <chunkstar/store/lower_tier.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Why a chunk moves (counted separately in runtime_stats). */
enum class move_reason : std::uint8_t { load, evict, offload };

/** @brief The chunks of a runtime on platform @p P. */
template <Platform P>
class chunk_store {
 public:
  using device_space_type = typename P::device_space;
  using host_space_type = typename P::host_space;
  using copy_engine_type = typename P::copy_engine;
  using stream_type = typename P::stream_type;
  using copy_handle = decltype(std::declval<copy_engine_type&>().copy_async(nullptr, nullptr, 0, copy_direction::to_device));

  /** @brief Whether host code may dereference compute-tier payloads (the simulated device). */
  static constexpr bool device_is_host_accessible = can_access_v<host_exec, device_space_type>;

  /** @brief One chunk. `last_use` / `loaded_at` are ticks (see eviction_candidate). */
  struct slot {
    tier where = tier::free;              ///< logical tier; decisions use only logical state
    void* data = nullptr;                 ///< payload in `where` (valid once `pending` is ready)
    std::optional<copy_handle> pending;   ///< the copy (or zero fill) into `data`, until seen complete
    std::optional<copy_handle> user_done; ///< the user's work on this payload (scope closed on a stream)
    std::size_t last_use = 0;             ///< LRU tick of the latest access
    std::size_t loaded_at = 0;            ///< tick of its arrival on its tier
    std::uint32_t pinned = 0;             ///< open scopes / steps / collectives using it: never moves while > 0
    bool prefetched = false;              ///< loaded ahead of its use and not used since
    int owner = 0;                        ///< the rank that owns it (ZeRO)
    void* group = nullptr;                ///< the group buffer its payload lives in (ZeRO), or null: its own
    using disk_move = lower_move;
    std::optional<lower_move> disk_pending;  ///< a copy to or from the lower tier (lower_tier.hpp)
  };

  chunk_store(device_space_type& device, host_space_type& host, copy_engine_type& copier, std::size_t alignment,
              runtime_stats& stats)
      : device_(device), host_(host), copier_(copier), alignment_(alignment), stats_(stats) {}
  chunk_store(const chunk_store&) = delete;
  chunk_store& operator=(const chunk_store&) = delete;
  ~chunk_store();

  // --- shape ---------------------------------------------------------------------------------------
  /** @brief Creates the slots of @p lists (all FREE); chunk c is owned by rank c mod @p world. */
  void build(std::span<const chunk_list_desc> lists, int world);
  /** @brief Adds the tier below the host (before any chunk has a payload): chunks may then live on
   *  tier::disk, moved there and back by @p t (disk_moves.hpp: `attach_disk`). */
  void attach_lower(std::unique_ptr<lower_tier> t) noexcept { lower_ = std::move(t); }
  [[nodiscard]] lower_tier* lower() const noexcept { return lower_.get(); }
  [[nodiscard]] bool has_disk() const noexcept { return lower_ != nullptr; }
  /** @brief The lower tier's capacity in bytes (0 without one). */
  [[nodiscard]] std::size_t disk_capacity() const { return lower_ ? lower_->space().capacity() : 0; }
  /** @brief Bytes a payload of @p bytes occupies on tier @p t: with a lower tier, host and disk
   *  payloads are whole 4 KiB blocks (O_DIRECT moves whole blocks, so a chunk's last block needs no
   *  read-modify-write); what resident() counts. */
  [[nodiscard]] std::size_t footprint(tier t, std::size_t bytes) const noexcept;
  [[nodiscard]] bool has(chunk_kind k) const noexcept { return lists_[static_cast<std::size_t>(k)].present; }
  [[nodiscard]] const chunk_list_desc& desc(chunk_kind k) const { return lists_[static_cast<std::size_t>(k)].desc; }
  [[nodiscard]] std::size_t bytes_of(chunk_kind k) const { return desc(k).chunk_bytes; }
  [[nodiscard]] std::size_t num_chunks() const noexcept { return num_chunks_; }
  [[nodiscard]] slot& at(chunk_id id) { return lists_[static_cast<std::size_t>(id.kind)].chunks.at(id.index); }
  [[nodiscard]] const slot& at(chunk_id id) const { return lists_[static_cast<std::size_t>(id.kind)].chunks.at(id.index); }
  /** @brief Calls `f(chunk_id, slot&)` for every chunk of every list, kinds in enum order. */
  template <class F>
  void for_each(F&& f) { for_each_in(*this, f); }
  template <class F>
  void for_each(F&& f) const { for_each_in(*this, f); }
  /** @brief Bytes of every list's chunks (what device + host hold). */
  [[nodiscard]] std::size_t model_bytes() const noexcept;

  // --- residency -----------------------------------------------------------------------------------
  /** @brief Logical chunk payload bytes on tier @p t (a payload with a copy in flight counts where it goes). */
  [[nodiscard]] std::size_t resident(tier t) const noexcept { return resident_[static_cast<std::size_t>(t)]; }
  /** @brief Bytes of buffers on tier @p t that in-flight copies still read (freed when they land). */
  [[nodiscard]] std::size_t retiring(tier t) const noexcept;
  /** @brief A new tick (accesses and arrivals share it, so ticks order events). */
  std::size_t tick() noexcept { return ++tick_; }
  [[nodiscard]] std::size_t current_tick() const noexcept { return tick_; }
  /** @brief Chunk @p id is used now (LRU). */
  void touch(chunk_id id) { at(id).last_use = tick(); }

  // --- pins ----------------------------------------------------------------------------------------
  void pin(chunk_id id) { ++at(id).pinned; }
  void unpin(chunk_id id) noexcept { --lists_[static_cast<std::size_t>(id.kind)].chunks[id.index].pinned; }
  using pin_set = chunk_pins<chunk_store>;

  /** @brief A chunk pinned where it is, for work on its payload outside a scope (a collective). */
  struct held_payload {
    pin_set pin;
    void* data = nullptr;
    std::size_t elems = 0;  ///< elements of the chunk (its capacity)
    dtype type = dtype::f32;
  };
  /** @brief Pins chunk @p id (a FREE one first gets a zeroed payload on the host) once its copy
   *  landed and the user's work on it finished. */
  [[nodiscard]] held_payload hold(chunk_id id);

  // --- mechanics -----------------------------------------------------------------------------------
  /** @brief Gives every chunk of every list but the gradients (FREE until first used) a zeroed
   *  payload at finalize, as allocate_initial(id); with @p sharded, only the chunks rank @p rank
   *  owns: the others are `remote`. */
  void allocate_initial(bool sharded = false, int rank = 0);
  /** @brief Gives chunk @p id a zeroed payload at finalize: on the host, spilling to the device
   *  (then the lower tier) when the host is full (model data may exceed either tier alone). */
  void allocate_initial(chunk_id id);

  /** @brief Starts moving chunk @p id's payload to tier @p to. The logical tier changes at once;
   *  the old buffer retires when the copy lands. A device destination takes a free buffer when the
   *  device has room for it plus @p device_reserve bytes (what this moment's activations may still
   *  need), else the buffer of an eviction still in flight (the load ordered after it). A move to
   *  or from the lower tier is the lower tier's (lower_tier::move). @throws out_of_memory_error
   *  when @p to has no room; state_error if @p id is pinned. */
  void move(chunk_id id, tier to, move_reason why, std::size_t device_reserve = 0);

  /** @brief Gives FREE chunk @p id a zeroed payload on @p where: on the device zeroed by the copy
   *  engine's local lane (a memset off the critical path; the scope that uses it waits for it).
   *  @p device_reserve as for move(). */
  void materialise(chunk_id id, tier where, std::size_t device_reserve = 0);

  /** @brief Drops chunk @p id's payload (FREE; a gradient after its step). Waits for a copy into
   *  it first; a failed copy is dropped with the payload. */
  void release(chunk_id id) noexcept;

  /** @brief Waits until chunk @p id's payload has arrived (stall time counted); rethrows a failed
   *  copy. A failed lower-tier copy puts the chunk back where it was (resolve_disk); after a failed
   *  device copy the payload is not valid and the chunk keeps its tier. */
  void wait(chunk_id id) { wait(at(id)); }
  void wait(slot& s);
  /** @brief Throws state_error unless chunk @p id has a payload on this rank (a `remote` chunk must
   *  be gathered first: reading it is never reading zeros). */
  void require_payload(chunk_id id, const char* what) const;
  /** @brief Waits (on the host) for the user's work still using @p s's payload, before the host
   *  itself reads or writes it. */
  void wait_user(slot& s);
  /** @brief Frees the buffers of finished copies and forgets finished slot copies; never waits.
   *  @throws io_error (or corruption_error) for a finished lower-tier copy that failed: that chunk
   *  is back where it was (resolve_disk), the others are retired. */
  void retire_completed();
  /** @brief Ends chunk @p id's lower-tier copy, waiting for it (lower_tier::resolve). */
  void resolve_disk(chunk_id id) {
    if (at(id).disk_pending) lower_->resolve(id);
  }
  /** @brief Frees the buffers on tier @p t whose copies are done, or else waits for the oldest copy
   *  still reading one; false if no copy reads a buffer on @p t. */
  bool retire_one(tier t);
  /** @brief The user's work up to @p done uses chunk @p id's payload: its next move waits for it. */
  void order_after_user(chunk_id id, const copy_handle& done) { at(id).user_done = done; }

  /** @brief A buffer of @p bytes on tier @p t, retiring finished copies (or waiting for one) until
   *  there is room; null when there is none. */
  void* allocate(tier t, std::size_t bytes);
  void deallocate(tier t, void* p, std::size_t bytes) noexcept;
  /** @brief Chunk @p id's payload becomes @p data on @p to (its old one is the caller's), counted
   *  there; @p arrival: a new tick for `loaded_at`. */
  void relocate(chunk_id id, void* data, tier to, bool arrival) noexcept;

  // --- unslotted buffers: device memory outside payloads (a collective's) --------------------------
  /** @brief A device buffer outside any payload, counted as unslotted collective memory until
   *  freed; null when the device has no room (after retiring copies). */
  void* allocate_unslotted(std::size_t bytes);
  void free_unslotted(void* p, std::size_t bytes) noexcept;
  /** @brief Chunk @p id (no payload) gets the chunk-sized part at @p p of an unslotted buffer as
   *  its device payload; unplace gives it back, the chunk becoming @p after. */
  void place(chunk_id id, void* p) noexcept;
  void unplace(chunk_id id, tier after) noexcept;
  /** @brief Chunk @p id's placed payload becomes its own (freed with it, no longer collective). */
  void own(chunk_id id) noexcept { collective_ -= bytes_of(id.kind); }
  /** @brief Bytes on the device outside chunk payloads: scratch and unused group positions. */
  [[nodiscard]] std::size_t unslotted() const noexcept { return unslotted_; }
  /** @brief What the chunk budget governs on the device: payloads plus collective buffers. */
  [[nodiscard]] std::size_t device_in_use() const noexcept { return resident(tier::device) + unslotted_; }

  // --- stats and reports ---------------------------------------------------------------------------
  /** @brief Zeroes the stats' counters; the peaks restart from the current levels (@p non_model:
   *  the non-model bytes live now). */
  void reset_stats(std::size_t non_model) noexcept;
  /** @brief Restarts the chunk and device peaks of the stats from the current levels. */
  void restart_peaks() noexcept;
  /** @brief Records the device space's use in `peak_device_bytes` (call after allocating from it). */
  void note_device_peak() noexcept { stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, device_.used()); }
  [[nodiscard]] runtime_stats& stats() noexcept { return stats_; }
  /** @brief What is wrong with the bookkeeping (empty: nothing). @p pins_allowed: scopes or a
   *  step are open, so chunks may be pinned; @p sole_user: nothing else allocates from the device
   *  space, so its use must equal what the runtime accounts for (no leak). */
  [[nodiscard]] std::vector<std::string> violations(bool pins_allowed, std::size_t non_model, bool sole_user) const;
  [[nodiscard]] memory_report report() const;
  device_space_type& device() noexcept { return device_; }
  host_space_type& host() noexcept { return host_; }
  copy_engine_type& copier() noexcept { return copier_; }

  /** @brief Called with (submitted µs, source tier, destination tier) for every copy whose source
   *  buffer retires. */
  std::function<void(double, tier, tier)> on_copy_retired;
  /** @brief Clock of the observer (µs), for copy spans; none: 0. */
  std::function<double()> clock;
  [[nodiscard]] double now_us() const noexcept;

 private:
  /** A payload buffer an in-flight copy still reads (the chunk has moved on); freed once `done`. */
  struct retiring_buffer {
    copy_handle done;
    void* buffer = nullptr;  // null once a load took it over (device_buffer)
    tier where = tier::free;
    std::size_t bytes = 0;
    double submitted_us = 0;
    bool user = false;  // `done` is the user's work, not a copy
  };
  struct list {
    bool present = false;
    chunk_list_desc desc;
    std::vector<slot> chunks;
  };
  /** A buffer for a new payload; `reused` holds the copy that still reads it when it was taken
   *  over from an eviction in flight. */
  struct buffer {
    void* p = nullptr;
    std::optional<copy_handle> reused;
  };

  template <class Self, class F>
  static void for_each_in(Self& self, F& f) {
    for (std::size_t k = 0; k < num_chunk_kinds; ++k) {
      if (!self.lists_[k].present) continue;
      for (std::uint32_t c = 0; c < self.lists_[k].chunks.size(); ++c) f(chunk_id{static_cast<chunk_kind>(k), c}, self.lists_[k].chunks[c]);
    }
  }
  void* allocate_on(tier t, std::size_t bytes);
  [[nodiscard]] chunk_id id_of(const slot& s) const noexcept;  // slots live in the lists' vectors
  void free_payload(slot& s, std::size_t bytes) noexcept;
  /** Hands @p s's payload to the retiring buffers until the user's work on it is done; false (the
   *  payload untouched, that work waited for) when there is no room to remember it. */
  bool retire_after_user(slot& s, std::size_t bytes) noexcept;
  void release(retiring_buffer& r) noexcept;
  /** Undoes getting @p b after a failure: a taken-over buffer goes back to retire with its copy
   *  (capacity was reserved), a fresh one is freed. */
  void give_back(buffer& b, tier t, std::size_t bytes) noexcept;
  /** A device buffer of @p bytes for a job on @p lane that never blocks the caller: a free one when
   *  the device has room for it and for @p reserve more bytes; else the buffer of the oldest
   *  eviction still in flight (same size), with @p lane ordered after that eviction's copy; else a
   *  free one if any. Null when none exists. */
  buffer device_buffer(std::size_t bytes, copy_direction lane, std::size_t reserve);
  void count(tier t, std::size_t bytes, int sign) noexcept;
  void note_model_peak() noexcept;

  device_space_type& device_;
  host_space_type& host_;
  copy_engine_type& copier_;
  std::size_t alignment_;
  runtime_stats& stats_;
  std::array<list, num_chunk_kinds> lists_;
  std::vector<retiring_buffer> retiring_;  // buffers in-flight copies still read, oldest first
  std::size_t unslotted_ = 0;              // device bytes outside payloads: scratch, unused group positions
  std::size_t collective_ = 0;             // bytes of unslotted buffers not owned by a chunk (group buffers, scratch)
  std::array<std::size_t, num_tiers> resident_{};
  std::size_t num_chunks_ = 0;
  std::size_t tick_ = 0;
  std::unique_ptr<lower_tier> lower_;  // the tier below the host, when attached
};

template <Platform P>
chunk_store<P>::~chunk_store() {
  try {
    copier_.synchronize();
  } catch (...) {  // a failed copy was (or will never be) reported by its handle; free anyway
  }
  if (lower_) lower_->drain();
  for (auto& r : retiring_) {
    try {
      if (r.user) r.done.wait();  // the user's work still reading it (copies were waited for above)
    } catch (...) {  // freed anyway: the work's failure is the user's to see
    }
    release(r);
  }
  for (std::size_t k = 0; k < num_chunk_kinds; ++k)  // group members were given back by their owner
    for (auto& s : lists_[k].chunks) free_payload(s, lists_[k].desc.chunk_bytes);
}

template <Platform P>
void chunk_store<P>::build(std::span<const chunk_list_desc> lists, int world) {
  for (const auto& d : lists) {
    auto& l = lists_[static_cast<std::size_t>(d.kind)];
    l.present = true;
    l.desc = d;
    l.chunks.resize(d.num_chunks);
    for (std::size_t c = 0; c < d.num_chunks; ++c) l.chunks[c].owner = static_cast<int>(c % static_cast<std::size_t>(world));
    num_chunks_ = d.num_chunks;
  }
}

template <Platform P>
std::size_t chunk_store<P>::footprint(tier t, std::size_t bytes) const noexcept {
  if (!lower_ || t == tier::device) return bytes;
  const std::size_t b = std::max<std::size_t>(alignment_, 4096);
  return (bytes + b - 1) / b * b;
}

template <Platform P>
std::size_t chunk_store<P>::model_bytes() const noexcept {
  std::size_t b = 0;
  for (const auto& l : lists_)
    if (l.present && !l.desc.aliases_param) b += l.desc.chunk_bytes * l.desc.num_chunks;
  return b;
}

template <Platform P>
std::size_t chunk_store<P>::retiring(tier t) const noexcept {
  std::size_t b = lower_ ? lower_->retiring(t) : 0;
  for (const auto& r : retiring_)
    if (r.buffer != nullptr && r.where == t) b += footprint(t, r.bytes);
  return b;
}

template <Platform P>
auto chunk_store<P>::hold(chunk_id id) -> held_payload {
  if (at(id).where == tier::free) materialise(id, tier::host);
  if (at(id).where == tier::disk) {  // a collective works on memory
    move(id, tier::host, move_reason::load);
    ++stats_.disk_demand_reads;
  }
  wait(id);
  wait_user(at(id));
  const auto& d = desc(id.kind);
  return {pin_set(*this, {id}), at(id).data, d.chunk_bytes / dtype_size(d.type), d.type};
}

template <Platform P>
void chunk_store<P>::allocate_initial(bool sharded, int rank) {
  for_each([&](chunk_id id, slot& s) {
    if (sharded && s.owner != rank) s.where = tier::remote;
    else if (id.kind != chunk_kind::grad) allocate_initial(id);
  });
}

template <Platform P>
void chunk_store<P>::allocate_initial(chunk_id id) {
  auto& s = at(id);
  const std::size_t bytes = bytes_of(id.kind);
  tier got = tier::host;
  void* p = allocate_on(tier::host, bytes);
  if (p == nullptr) p = allocate_on(got = tier::device, bytes);
  if (p == nullptr && lower_) p = allocate_on(got = tier::disk, bytes);
  if (p == nullptr)
    throw out_of_memory_error("model data does not fit: a chunk of " + format_bytes(bytes) + " found no room on the host, the device" +
                                  (lower_ ? " or the disk" : " (and there is no disk tier)") + " (model data " + format_bytes(model_bytes()) +
                                  "). Raise the host space's capacity or the device space's" + (lower_ ? " or the disk's" : ", attach a disk tier") +
                                  ", use a smaller model, or fewer optimizer-state lists (runtime_options::optimizer_state)",
                              bytes, report());
  try {
    if (got == tier::disk) lower_->zero(p, footprint(tier::disk, bytes));
    else if (got == tier::host || device_is_host_accessible) std::memset(p, 0, bytes);
    else copier_.zero_async(p, bytes).wait();
  } catch (...) {
    deallocate(got, p, bytes);
    throw;
  }
  s.data = p;
  s.where = got;
  s.loaded_at = tick();
  count(got, bytes, +1);
}

template <Platform P>
void chunk_store<P>::move(chunk_id id, tier to, move_reason why, std::size_t device_reserve) {
  auto& s = at(id);
  if (s.pinned)  // the invariant every caller must keep: a chunk in use never moves
    throw state_error("internal: chunk " + to_string(id) + " is in use and cannot move to the " + std::string(tier_name(to)) +
                      "; please report this as a chunkstar bug");
  if (!holds_payload(s.where)) throw state_error("internal: chunk " + to_string(id) + " has no payload to move");
  resolve_disk(id);  // a chunk moves on only from bytes known to be good
  if (to == tier::disk || s.where == tier::disk) {
    if (!lower_) throw state_error("internal: chunk " + to_string(id) + " cannot move to or from the disk: no disk tier is attached");
    return lower_->move(id, to);
  }
  const std::size_t bytes = bytes_of(id.kind);
  const auto dir = to == tier::device ? copy_direction::to_device : copy_direction::to_host;
  retiring_.reserve(retiring_.size() + 2);  // recording the copy (or giving back a buffer) cannot throw
  buffer dst = to == tier::device ? device_buffer(bytes, dir, device_reserve) : buffer{};
  if (dst.p == nullptr) dst.p = allocate(to, bytes);
  if (dst.p == nullptr) {
    std::string why;
    if (to == tier::device)
      why = ": the device is full of non-model data; raise the device space's capacity or lower the activation memory";
    else if (!lower_)
      why = ": host and device are both full; raise the host space's capacity";
    else  // the disk may have room, but everything on the host is in use or on its way to or from the disk
      why = ": the host's " + format_bytes(host_.capacity()) + " hold chunks in use or in transit, none of which can go to the disk now (it holds " +
            format_bytes(resident(tier::disk)) + " of its " + format_bytes(disk_capacity()) +
            "); with a disk tier, chunks pass through the host on their way to and from the disk and a host-side optimizer step holds up "
            "to five chunks at once: raise the host space's capacity (train_gpt asks for 8 of the largest chunk)";
    throw out_of_memory_error("no room on the " + std::string(tier_name(to)) + " for chunk " + to_string(id) + " (" + format_bytes(bytes) + ")" + why,
                              bytes, report());
  }
  const double submitted_us = now_us();
  std::optional<copy_handle> h;
  try {
    // Ordered after what still uses the source: the user's work on it, and its own last copy.
    if (s.user_done) copier_.order_after(*s.user_done, dir);
    if (s.pending && !s.pending->ready()) copier_.order_after(*s.pending, dir);
    h = copier_.copy_async(dst.p, s.data, bytes, dir);
  } catch (...) {
    give_back(dst, to, bytes);
    throw;
  }
  retiring_.push_back({*h, s.data, s.where, bytes, submitted_us});
  s.pending = std::move(h);
  s.user_done.reset();
  relocate(id, dst.p, to, true);
  (to == tier::device ? stats_.bytes_to_device : stats_.bytes_to_host) += bytes;
  ++(why == move_reason::load ? stats_.loads : why == move_reason::evict ? stats_.evictions : stats_.offloads);
}

template <Platform P>
void chunk_store<P>::materialise(chunk_id id, tier where, std::size_t device_reserve) {
  auto& s = at(id);
  if (holds_payload(s.where)) throw state_error("internal: chunk " + to_string(id) + " already has a payload");
  const std::size_t bytes = bytes_of(id.kind);
  retiring_.reserve(retiring_.size() + 1);
  buffer p = where == tier::device ? device_buffer(bytes, copy_direction::host_to_host, device_reserve) : buffer{};
  if (p.p == nullptr) p.p = allocate(where, bytes);
  if (p.p == nullptr)
    throw out_of_memory_error("no room on the " + std::string(tier_name(where)) + " for chunk " + to_string(id) + " (" +
                                  format_bytes(bytes) + "): raise that space's capacity",
                              bytes, report());
  std::optional<copy_handle> h;
  if (where == tier::device) {
    try {
      h = copier_.zero_async(p.p, bytes);
    } catch (...) {
      give_back(p, where, bytes);
      throw;
    }
  } else {
    std::memset(p.p, 0, bytes);
  }
  s.data = p.p;
  s.where = where;
  s.pending = std::move(h);
  s.loaded_at = tick();
  count(where, bytes, +1);
  ++stats_.materialised;
}

template <Platform P>
void chunk_store<P>::release(chunk_id id) noexcept {
  auto& s = at(id);
  if (!holds_payload(s.where) || s.group != nullptr) return;  // a group member goes with its group
  if (s.disk_pending) lower_->discard(id);
  if (s.pending) {
    try {
      s.pending->wait();
    } catch (...) {  // the payload is discarded: its copy's failure no longer matters
    }
    s.pending.reset();
  }
  count(s.where, bytes_of(id.kind), -1);
  // The user's work may still read it (an asynchronous optimizer step): it retires, freed
  // once that work is done, like a buffer an eviction in flight still reads.
  if (!(s.user_done && !s.user_done->ready() && retire_after_user(s, bytes_of(id.kind)))) free_payload(s, bytes_of(id.kind));
  s.user_done.reset();
  s.prefetched = false;
}

template <Platform P>
void chunk_store<P>::wait(slot& s) {
  if (s.disk_pending) lower_->resolve(id_of(s));
  if (!s.pending) return;
  if (!s.pending->ready()) {
    const auto t0 = std::chrono::steady_clock::now();
    s.pending->wait();
    stats_.stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  s.pending->wait();
  s.pending.reset();
}

template <Platform P>
void chunk_store<P>::require_payload(chunk_id id, const char* what) const {
  const auto& s = at(id);
  if (!holds_payload(s.where))
    throw state_error("cannot " + std::string(what) + " chunk " + to_string(id) + ": it has no payload on this rank (" +
                      std::string(tier_name(s.where)) + (s.where == tier::remote ? ", held by rank " + std::to_string(s.owner) + "): gather it first" : ")"));
}

template <Platform P>
void chunk_store<P>::wait_user(slot& s) {
  if (!s.user_done) return;
  s.user_done->wait();
  s.user_done.reset();
}

template <Platform P>
void chunk_store<P>::retire_completed() {
  std::erase_if(retiring_, [&](retiring_buffer& r) {
    if (!r.done.ready()) return false;
    release(r);
    return true;
  });
  std::exception_ptr failure;
  for_each([&](chunk_id id, slot& s) {
    if (s.disk_pending && s.disk_pending->done.ready()) {
      try {
        lower_->resolve(id);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    if (s.pending && s.pending->ready()) wait(s);
  });
  if (failure) std::rethrow_exception(failure);
}

template <Platform P>
bool chunk_store<P>::retire_one(tier t) {
  const auto before = retiring_.size(), held = retiring(t);
  retire_completed();
  if (retiring_.size() != before || retiring(t) != held) return true;
  for (auto& r : retiring_) {
    if (r.buffer == nullptr || r.where != t) continue;
    const auto t0 = std::chrono::steady_clock::now();
    r.done.wait();
    stats_.stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    retire_completed();
    return true;
  }
  return lower_ && lower_->resolve_one(t);  // a lower-tier copy still reading a payload on t
}

template <Platform P>
void* chunk_store<P>::allocate(tier t, std::size_t bytes) {
  for (;;)
    if (void* p = allocate_on(t, bytes); p != nullptr || !retire_one(t)) return p;
}

template <Platform P>
void chunk_store<P>::deallocate(tier t, void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  bytes = footprint(t, bytes);
  if (t == tier::device) device_.deallocate(p, bytes, alignment_);
  else if (t == tier::disk) lower_->space().deallocate(p, bytes, alignment_);
  else host_.deallocate(p, bytes, alignment_);
}

template <Platform P>
void chunk_store<P>::relocate(chunk_id id, void* data, tier to, bool arrival) noexcept {
  auto& s = at(id);
  count(s.where, bytes_of(id.kind), -1);
  s.data = data;
  s.where = to;
  if (arrival) s.loaded_at = tick();
  count(to, bytes_of(id.kind), +1);
}

template <Platform P>
void* chunk_store<P>::allocate_unslotted(std::size_t bytes) {
  void* p = allocate(tier::device, bytes);
  if (p == nullptr) return nullptr;
  unslotted_ += bytes;
  collective_ += bytes;
  note_device_peak();
  note_model_peak();
  return p;
}

template <Platform P>
void chunk_store<P>::free_unslotted(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  deallocate(tier::device, p, bytes);
  unslotted_ -= bytes;
  collective_ -= bytes;
}

template <Platform P>
void chunk_store<P>::place(chunk_id id, void* p) noexcept {
  auto& s = at(id);
  unslotted_ -= bytes_of(id.kind);  // before counting it resident: the peaks never see it twice
  s.data = p;
  s.where = tier::device;
  s.loaded_at = tick();
  count(tier::device, bytes_of(id.kind), +1);
}

template <Platform P>
void chunk_store<P>::unplace(chunk_id id, tier after) noexcept {
  auto& s = at(id);
  count(tier::device, bytes_of(id.kind), -1);
  s.data = nullptr;
  s.where = after;
  s.pending.reset();
  s.user_done.reset();
  unslotted_ += bytes_of(id.kind);
}

template <Platform P>
void chunk_store<P>::reset_stats(std::size_t non_model) noexcept {
  stats_ = {};
  stats_.peak_non_model_bytes = non_model;
  restart_peaks();
}

template <Platform P>
void chunk_store<P>::restart_peaks() noexcept {
  stats_.peak_device_bytes = device_.used();
  stats_.peak_device_chunk_bytes = resident(tier::device);
  stats_.peak_host_chunk_bytes = resident(tier::host);
  stats_.peak_disk_chunk_bytes = resident(tier::disk);
  stats_.peak_model_bytes = resident(tier::device) + resident(tier::host) + unslotted_;
  stats_.peak_collective_bytes = 0;
  note_model_peak();
}

template <Platform P>
std::vector<std::string> chunk_store<P>::violations(bool pins_allowed, std::size_t non_model, bool sole_user) const {
  std::vector<std::string> v;
  std::array<std::size_t, num_tiers> sum{};
  for_each([&](chunk_id id, const slot& s) {
    if (holds_payload(s.where) != (s.data != nullptr)) v.push_back(to_string(id) + ": payload and tier disagree");
    if (holds_payload(s.where)) sum[static_cast<std::size_t>(s.where)] += footprint(s.where, bytes_of(id.kind));
    if (s.pinned > (s.group ? 1u : 0u) && !pins_allowed) v.push_back(to_string(id) + " is pinned with no scope or step open");
  });
  for (auto t : {tier::device, tier::host, tier::disk})
    if (sum[static_cast<std::size_t>(t)] != resident(t)) v.push_back("resident bytes on the " + std::string(tier_name(t)) + " disagree with the slots");
  const std::size_t accounted = resident(tier::device) + retiring(tier::device) + unslotted_ + non_model;
  if (device_.used() < accounted || (sole_user && device_.used() != accounted))
    v.push_back("the device space holds " + std::to_string(device_.used()) + " bytes, the runtime accounts for " + std::to_string(accounted));
  return v;
}

template <Platform P>
memory_report chunk_store<P>::report() const {
  memory_report r;
  r.spaces.push_back(device_.usage());
  r.spaces.push_back(host_.usage());
  if (lower_) r.spaces.push_back(lower_->space().usage());
  r.spaces.push_back({"chunk payloads on device", device_.capacity(), resident(tier::device), stats_.peak_device_chunk_bytes, 0});
  r.spaces.push_back({"chunk payloads on host", host_.capacity(), resident(tier::host), stats_.peak_host_chunk_bytes, 0});
  if (lower_) r.spaces.push_back({"chunk payloads on disk", disk_capacity(), resident(tier::disk), stats_.peak_disk_chunk_bytes, 0});
  if (const auto b = retiring(tier::device)) r.spaces.push_back({"buffers in-flight copies read", device_.capacity(), b, b, 0});
  if (unslotted_) r.spaces.push_back({"collective buffers on device (ZeRO)", device_.capacity(), unslotted_, unslotted_, 0});
  return r;
}

template <Platform P>
double chunk_store<P>::now_us() const noexcept {
  try {
    return clock ? clock() : 0.0;
  } catch (...) {
    return 0.0;
  }
}

template <Platform P>
void* chunk_store<P>::allocate_on(tier t, std::size_t bytes) {
  bytes = footprint(t, bytes);
  if (t == tier::disk) return lower_ ? lower_->space().try_allocate(bytes, alignment_) : nullptr;
  return t == tier::device ? device_.try_allocate(bytes, alignment_) : host_.try_allocate(bytes, alignment_);
}

template <Platform P>
chunk_id chunk_store<P>::id_of(const slot& s) const noexcept {
  for (std::size_t k = 0; k < num_chunk_kinds; ++k) {
    const auto& v = lists_[k].chunks;
    if (!v.empty() && &s >= v.data() && &s < v.data() + v.size())
      return {static_cast<chunk_kind>(k), static_cast<std::uint32_t>(&s - v.data())};
  }
  return {};
}

template <Platform P>
void chunk_store<P>::free_payload(slot& s, std::size_t bytes) noexcept {
  if (s.data == nullptr) return;
  deallocate(s.where, s.data, bytes);
  s.data = nullptr;
  s.where = tier::free;
}

template <Platform P>
bool chunk_store<P>::retire_after_user(slot& s, std::size_t bytes) noexcept {
  if (s.data == nullptr) return false;
  try {
    retiring_.push_back({*s.user_done, s.data, s.where, bytes, now_us(), /*user=*/true});
  } catch (...) {
    try {
      s.user_done->wait();
    } catch (...) {  // the payload is discarded: the work's failure is the user's to see
    }
    return false;
  }
  s.data = nullptr;
  s.where = tier::free;
  return true;
}

template <Platform P>
void chunk_store<P>::release(retiring_buffer& r) noexcept {
  if (r.buffer != nullptr) {
    deallocate(r.where, r.buffer, r.bytes);
    r.buffer = nullptr;
  }
  if (on_copy_retired && !r.user) {
    try {
      on_copy_retired(r.submitted_us, r.where, r.where == tier::device ? tier::host : tier::device);
    } catch (...) {  // an observer must not break memory management
    }
  }
}

template <Platform P>
void chunk_store<P>::give_back(buffer& b, tier t, std::size_t bytes) noexcept {
  if (b.p == nullptr) return;
  if (b.reused) retiring_.push_back({*b.reused, b.p, t, bytes, now_us()});
  else deallocate(t, b.p, bytes);
  b.p = nullptr;
}

template <Platform P>
auto chunk_store<P>::device_buffer(std::size_t bytes, copy_direction lane, std::size_t reserve) -> buffer {
  if (device_.used() + bytes + reserve <= device_.capacity())
    if (void* p = device_.try_allocate(bytes, alignment_)) return {p, std::nullopt};
  for (auto& r : retiring_) {  // oldest first
    if (r.buffer == nullptr || r.where != tier::device || r.bytes != bytes) continue;
    copier_.order_after(r.done, lane);
    ++stats_.buffer_reuses;
    return {std::exchange(r.buffer, nullptr), r.done};  // the eviction no longer frees it: it is ours
  }
  return {device_.try_allocate(bytes, alignment_), std::nullopt};
}

template <Platform P>
void chunk_store<P>::count(tier t, std::size_t bytes, int sign) noexcept {
  bytes = footprint(t, bytes);
  auto& r = resident_[static_cast<std::size_t>(t)];
  r = sign > 0 ? r + bytes : r - bytes;
  stats_.peak_device_chunk_bytes = std::max(stats_.peak_device_chunk_bytes, resident(tier::device));
  stats_.peak_host_chunk_bytes = std::max(stats_.peak_host_chunk_bytes, resident(tier::host));
  stats_.peak_disk_chunk_bytes = std::max(stats_.peak_disk_chunk_bytes, resident(tier::disk));
  note_device_peak();
  note_model_peak();
}

template <Platform P>
void chunk_store<P>::note_model_peak() noexcept {
  stats_.peak_collective_bytes = std::max(stats_.peak_collective_bytes, collective_);
  stats_.peak_model_bytes = std::max(stats_.peak_model_bytes, resident(tier::device) + resident(tier::host) + unslotted_);
}

}  // namespace chunkstar
