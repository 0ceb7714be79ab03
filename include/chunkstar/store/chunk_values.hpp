// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_values`: reading and writing a chunk's bytes, or a tensor's values as fp32 across
 *         the chunk's dtype, wherever the payload lives (device, host or the lower tier). Host code
 *         never dereferences a payload it cannot reach: the copy engine or the lower tier copies.
 *
 *  Each call waits for the copy into the payload and for the user's work on it first; a failed
 *  call changes no chunk's tier (a FREE chunk written to gets its zeroed payload first, kept).
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/memory/copy_engine.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Value I/O on the chunks of @p Store (a chunk_store), as a view: `chunk_values(store)`. */
template <class Store>
class chunk_values {
 public:
  explicit chunk_values(Store& store) noexcept : store_(store) {}

  /** @brief Copies @p out.size() bytes at byte @p offset of chunk @p id's payload into @p out. */
  void read_bytes(chunk_id id, std::size_t offset, std::span<std::byte> out) const {
    const std::byte* src = static_cast<const std::byte*>(ready(id, "read")) + offset;
    const tier where = store_.at(id).where;
    if (where == tier::disk) store_.lower()->copy(out.data(), src, out.size(), copy_direction::to_device);
    else if (where == tier::device && !Store::device_is_host_accessible)
      store_.copier().copy(out.data(), src, out.size(), copy_direction::to_host);
    else std::memcpy(out.data(), src, out.size());
  }
  /** @brief Writes @p in at byte @p offset of chunk @p id's payload. */
  void write_bytes(chunk_id id, std::size_t offset, std::span<const std::byte> in) const {
    std::byte* dst = static_cast<std::byte*>(ready(id, "write")) + offset;
    const tier where = store_.at(id).where;
    if (where == tier::disk) store_.lower()->copy(dst, in.data(), in.size(), copy_direction::to_host);
    else if (where == tier::device && !Store::device_is_host_accessible)
      store_.copier().copy(dst, in.data(), in.size(), copy_direction::to_device);
    else std::memcpy(dst, in.data(), in.size());
  }

  /** @brief Reads @p out.size() elements at element @p offset of chunk @p id as fp32 (a FREE
   *  chunk reads as zeros). */
  void read(chunk_id id, std::size_t offset, std::span<float> out) const {
    if (store_.at(id).where == tier::free) {
      std::fill(out.begin(), out.end(), 0.0f);
      return;
    }
    const dtype t = store_.desc(id.kind).type;
    std::vector<std::byte> staging(out.size() * dtype_size(t));
    read_bytes(id, offset * dtype_size(t), staging);
    widen_to_float(staging.data(), t, out);
  }
  /** @brief Writes @p in (narrowed with RNE) at element @p offset of chunk @p id; a FREE chunk
   *  gets a zeroed payload on the host first. */
  void write(chunk_id id, std::size_t offset, std::span<const float> in) const {
    if (store_.at(id).where == tier::free) store_.materialise(id, tier::host);
    const dtype t = store_.desc(id.kind).type;
    std::vector<std::byte> staging(in.size() * dtype_size(t));
    narrow_from_float(in, t, staging.data());
    write_bytes(id, offset * dtype_size(t), staging);
  }

  /** @brief The chunk of list @p k holding the tensor @p spec at @p slot, and its element offset,
   *  checking a buffer of @p n elements and that this rank holds the chunk (a `remote` one must be
   *  gathered first). @throws config_error, state_error naming the tensor. */
  [[nodiscard]] std::pair<chunk_id, std::size_t> locate(const tensor_spec& spec, const tensor_slot& slot, chunk_kind k,
                                                        std::size_t n) const {
    if (n != spec.numel())
      throw config_error("buffer of " + std::to_string(n) + " elements for parameter '" + spec.name + "' of " +
                         std::to_string(spec.numel()) + " elements: pass a buffer of its size");
    if (!store_.has(k))
      throw config_error("the runtime has no " + std::string(chunk_kind_name(k)) +
                         " list (see runtime_options::optimizer_state)");
    const chunk_id id{k, static_cast<std::uint32_t>(slot.chunk)};
    if (store_.at(id).where == tier::remote)
      throw state_error("parameter '" + spec.name + "' (" + to_string(id) + ") is held by rank " +
                        std::to_string(store_.at(id).owner) + ", not this one: read or write it on rank " +
                        std::to_string(store_.at(id).owner) + " (chunk_runtime::owner)" +
                        (k == chunk_kind::param ? ", read it inside a scope that uses it (gathered there)" : "") +
                        ", or save a checkpoint (every rank's tensors; load_checkpoint reads them in one process)");
    return {id, slot.offset};
  }

 private:
  /** Chunk @p id's payload once its copy landed and the user's work on it finished; state_error
   *  when this rank holds none. */
  void* ready(chunk_id id, const char* what) const {
    auto& s = store_.at(id);
    if (!holds_payload(s.where))  // a `remote` chunk must be gathered first: reading it is never reading zeros
      throw state_error(
          "cannot " + std::string(what) + " chunk " + to_string(id) + ": it has no payload on this rank (" +
          std::string(tier_name(s.where)) +
          (s.where == tier::remote ? ", held by rank " + std::to_string(s.owner) + "): gather it first" : ")"));
    store_.wait(s);
    store_.wait_user(s);
    return s.data;
  }

  Store& store_;
};

}  // namespace chunkstar
