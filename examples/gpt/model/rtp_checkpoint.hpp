// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Checkpoints of `gpt::rtp_gpt`: the library's RTP checkpoint views
 *         (chunkstar/rtp/checkpoint_view.hpp) over the GPT, which is a `chunkstar::rtp::ShardedModel`.
 *         A checkpoint saved under RTP loads in one process and under ZeRO, and one saved by
 *         either loads under RTP at any world size the model divides.
 */
#pragma once

#include "rtp_gpt.hpp"

#include <chunkstar/rtp/checkpoint_view.hpp>

namespace gpt {

/** @brief The save view of an `rtp_gpt`: construct it on every rank at the same point (it
 *  communicates), pass it to `chunkstar::save_checkpoint` on every rank, then drop it. */
template <chunkstar::Communicator Comm, chunkstar::rtp::ShardStore Store = chunkstar::rtp::host_shard_store,
          RtpBackend Backend = cpu_backend>
using rtp_save_view = chunkstar::rtp::checkpoint_save_view<rtp_gpt<Comm, Store, Backend>, Comm>;

/** @brief The load view of an `rtp_gpt`: `chunkstar::load_checkpoint(view, dir)` on every rank. */
template <chunkstar::Communicator Comm, chunkstar::rtp::ShardStore Store = chunkstar::rtp::host_shard_store,
          RtpBackend Backend = cpu_backend>
using rtp_load_view = chunkstar::rtp::checkpoint_load_view<rtp_gpt<Comm, Store, Backend>>;

}  // namespace gpt
