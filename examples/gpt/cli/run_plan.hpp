// SPDX-License-Identifier: Apache-2.0
// Before any work: what a train_gpt run is — where the layers run, how the ranks talk, the model,
// the data, the configuration a checkpoint stores, where it resumes — with every input checked
// (options, the data file, the checkpoint to resume and its configuration, the output paths).
#pragma once

#include "data.hpp"
#include "preflight.hpp"
#include "run_record.hpp"
#include "train_options.hpp"
#if GPT_HAS_CUDA_BACKEND
#include "gpt_backend_cuda.hpp"
#endif

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace gpt {

using namespace chunkstar;

struct run_plan {
  device_choice device;        // where the layers run
  transport_choice transport;  // how the ranks talk
  gpt_config cfg;
  text_data data;
  std::vector<record_field> record;  // the configuration a checkpoint stores
  std::optional<resume_state> resume;
  chunkstar::checkpoint_extra resume_entries;  // what resume was parsed from; the load must find the same
  std::int64_t first_step = 1, last_step = 0;
};

#if GPT_HAS_CUDA_BACKEND
inline constexpr bool cuda_built = true;
#else
inline constexpr bool cuda_built = false;
#endif
#if GPT_HAS_NCCL
inline constexpr bool nccl_built = true;
#else
inline constexpr bool nccl_built = false;
#endif

/** GPUs visible to this process; not asked when --device sim says none are wanted. */
inline int visible_gpus(const train_options& o) {
#if GPT_HAS_CUDA_BACKEND
  if (o.device != "sim") return cuda_device_count();
#endif
  (void)o;
  return 0;
}

inline run_plan prepare(const train_options& o, int ranks, node_place node) {
  run_plan p;
  p.cfg = model_config(o);
  validate_options(o, p.cfg);
  validate_ranks(o, ranks);
  p.device = resolve_device(o, cuda_built, visible_gpus(o), node);
  p.transport = resolve_transport(o, p.device, nccl_built);
  validate_allow_change(o.allow_change);
  if (!o.allow_change.empty() && o.resume.empty()) throw config_error("--allow-change applies only with --resume DIR");
  // Bytes per parameter (16 in every precision) before any layout is planned for an absurd shape.
  const double data_bytes = 16.0 * static_cast<double>(param_count(p.cfg));
  check_memory({.model_data = data_bytes > 1.8e19 ? SIZE_MAX : static_cast<std::size_t>(data_bytes)});

  p.data = load_text(o.data, static_cast<std::size_t>(o.seq));
  p.record = run_record(o, p.cfg, data_checksum(p.data.train, p.data.val));
  p.last_step = o.stop_after > 0 ? o.stop_after : o.steps;
  if (!o.resume.empty()) {
    p.resume_entries = read_checkpoint_extra(o.resume);
    check_resume_config(p.record, p.resume_entries, o.allow_change, o.resume);
    p.resume = parse_resume_state(p.resume_entries, o.resume);
    p.first_step = p.resume->step + 1;
    if (p.first_step > p.last_step)
      throw config_error("--resume '" + o.resume + "': the checkpoint completed step " +
                         std::to_string(p.resume->step) + " and this run ends at step " + std::to_string(p.last_step) +
                         (o.stop_after > 0 ? " (--stop-after)" : " (--steps)") +
                         ": nothing is left to train; raise --steps (with --allow-change steps) or --stop-after");
  }
  if (!o.save.empty()) check_checkpoint_target(o.save);
  if (!o.trace.empty()) probe_output_file("--trace", o.trace);
  return p;
}

/** The chunk layout: a fixed size if asked, else the searched layout's default, which fits its
 *  bounds to the tensors (from the largest tensor to 4x it, so a stage spans a few chunks). */
inline searched_chunk_layout make_layout(const train_options& o, const gpt_config& cfg) {
  if (o.chunk_elems == 0) return searched_chunk_layout();
  std::size_t largest = 0;
  for (const auto& s : param_specs(cfg)) largest = std::max(largest, s.numel());
  const std::size_t align = 32, lo = (largest + align - 1) / align * align;
  const std::size_t c = (static_cast<std::size_t>(o.chunk_elems) + align - 1) / align * align;
  if (c < lo)
    throw config_error("--chunk-elems " + std::to_string(o.chunk_elems) + " is smaller than the largest tensor (" +
                       std::to_string(largest) + " elements), and a tensor never straddles chunks: use at least " +
                       std::to_string(lo) + ", or 0 to search a size");
  return searched_chunk_layout({.min_chunk_elems = c, .max_chunk_elems = c, .step_elems = align, .align_elems = align});
}

}  // namespace gpt
