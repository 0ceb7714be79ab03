// train_gpt: a byte-level GPT trained with all of its model data in chunkstar.
//
// Read it top to bottom: options, data, memory, model, optimizer, then the training loop. The
// device is simulated on the CPU (host memory with a hard capacity), so the run shows what chunkstar
// does on a GPU whose memory is smaller than the model's data: chunks move, evictions happen, and
// the loss falls exactly as it would with everything resident (same bits).
#include "chunked_gpt.hpp"
#include "data.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/optim/lr_schedule.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

using namespace chunkstar;

namespace {

struct options {
  std::string data;  // empty: the embedded corpus
  std::string preset = "mini";
  int layers = 0, width = 0, heads = 0, context = 0;  // 0: from the preset
  std::size_t batch = 4, seq = 64;
  int accum = 1;
  std::int64_t steps = 200;
  std::int64_t stop_after = 0;  // stop early at this step (the schedule still spans --steps)
  std::string precision = "fp32";
  std::string policy = "patrickstar";
  std::string device_budget = "auto", host_budget = "unlimited", link_bandwidth = "0";
  double device_fraction = 0.4;  // --device-budget auto: activations + this share of the model data
  std::size_t chunk_elems = 0;   // 0: searched between the largest tensor and 4x it
  std::size_t prefetch = 2;
  float lr = 3e-3f, min_lr = 3e-4f, weight_decay = 0.1f, clip = 1.0f;
  std::int64_t warmup = 20;
  std::string schedule = "cosine";
  std::uint64_t seed = 1337;
  std::int64_t val_every = 50, val_batches = 8;
  std::string save, resume, trace;
  std::int64_t save_every = 0;
  int sample = 200;
};

std::size_t bytes_option(const std::string& name, const std::string& value) {
  if (value == "unlimited") return SIZE_MAX;
  const auto b = parse_bytes(value);
  if (!b) throw config_error(name + " '" + value + "' is not a size: write e.g. 64MiB, 1.5GiB or 1000000");
  return *b;
}

dtype precision_type(const std::string& p) {
  if (p == "fp32") return dtype::f32;
  if (p == "bf16") return dtype::bf16;
  if (p == "fp16") return dtype::f16;
  throw config_error("--precision '" + p + "': use fp32, bf16 or fp16");
}

/** The chunk layout: a fixed size if asked, else searched between the largest tensor and 4x it (so
 *  a stage spans a few chunks and there is something to move). */
searched_chunk_layout make_layout(const options& o, const gpt::gpt_config& cfg) {
  std::size_t largest = 0;
  for (const auto& s : gpt::param_specs(cfg)) largest = std::max(largest, s.numel());
  const std::size_t align = 32, lo = (largest + align - 1) / align * align;
  if (o.chunk_elems) {
    const std::size_t c = (o.chunk_elems + align - 1) / align * align;
    return searched_chunk_layout({.min_chunk_elems = c, .max_chunk_elems = c, .step_elems = align, .align_elems = align});
  }
  return searched_chunk_layout({.min_chunk_elems = lo, .max_chunk_elems = 4 * lo, .step_elems = align, .align_elems = align});
}

/** Peak non-model bytes on the compute tier for one micro-batch (activations, workspace, staging). */
std::size_t activation_bytes(const gpt::gpt_config& cfg, const options& o) {
  const auto s = gpt::compute_activation_sizes(cfg, o.batch, o.seq);
  std::size_t largest_stage = 0;
  for (const auto& l : gpt::param_layers(cfg)) {
    std::size_t n = 0;
    for (const auto& t : l.tensors) n += t.numel();
    largest_stage = std::max(largest_stage, n);
  }
  const std::size_t staging = precision_type(o.precision) == dtype::f32 ? 0 : 2 * (largest_stage + cfg.vocab * cfg.width);
  return (s.forward_total() + s.workspace + staging) * sizeof(float) + 64 * 1024;  // + alignment slack
}

// ------------------------------------------------------------------------------------------------
// The training run, for one runtime assembly and one loss scaler.
template <class Runtime, class Scaler>
int train(const options& o, const gpt::gpt_config& cfg, typename Runtime::placement_type placement) {
  // Data: bytes are tokens.
  const gpt::text_data data = gpt::load_text(o.data, o.seq);
  std::printf("data: %s, %zu train / %zu validation bytes\n", data.source.c_str(), data.train.size(), data.val.size());

  // Memory: a simulated device with a hard capacity, the host, and the link between them.
  const dtype type = precision_type(o.precision);
  const auto layout = make_layout(o, cfg);
  std::size_t model_bytes = 0;
  {  // the model data a runtime of this shape holds, to size the default budget
    const auto plan = layout.plan(gpt::param_specs(cfg, type));
    for (const auto& l : make_chunk_lists(plan, {.param_type = type})) model_bytes += l.chunk_bytes * l.num_chunks;
  }
  const std::size_t act = activation_bytes(cfg, o);
  const std::size_t device_capacity =
      o.device_budget == "auto" ? act + static_cast<std::size_t>(o.device_fraction * static_cast<double>(model_bytes))
                                : bytes_option("--device-budget", o.device_budget);
  const std::size_t host_capacity = bytes_option("--host-budget", o.host_budget);
  const double bandwidth = static_cast<double>(bytes_option("--link-bandwidth", o.link_bandwidth));
  const copy_model link{.bandwidth_bytes_per_s = bandwidth, .latency_s = bandwidth > 0 ? 10e-6 : 0.0};
  simulated_device_space device({.capacity = device_capacity, .link = link, .name = "device"});
  host_space host({.capacity = host_capacity});
  host_copy_engine copier(link);

  // The runtime and the model: every parameter registered in execution order.
  Runtime rt(device, host, copier, {.param_type = type, .prefetch_depth = o.prefetch, .timeline = !o.trace.empty()},
             layout, placement);
  gpt::chunked_gpt<Runtime> model(rt, cfg, {o.batch, o.seq}, o.seed);
  model.finalize();
  std::printf("model: %d layers, width %d, %d heads, context %d: %zu parameters\n", cfg.layers, cfg.width, cfg.heads,
              cfg.context, gpt::param_count(cfg));
  std::printf("memory: model data %s in %zu chunks of %zu elements (waste %.1f%%); device budget %s "
              "(activations %s), host budget %s%s\n",
              format_bytes(rt.model_bytes()).c_str(), rt.plan().num_chunks, rt.plan().chunk_elems,
              100.0 * rt.plan().waste_fraction(), format_bytes(device_capacity).c_str(), format_bytes(act).c_str(),
              host_capacity == SIZE_MAX ? "unlimited" : format_bytes(host_capacity).c_str(),
              rt.model_bytes() > device_capacity ? " -- the model data does not fit on the device: chunks will move" : "");

  // Optimizer: AdamW, no decay on biases and norms, warm-up then cosine, global-norm clipping.
  chunk_adam<Scaler> opt({.hyper = {.beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = o.weight_decay},
                          .max_grad_norm = o.clip},
                         param_groups::with_default_decay(o.weight_decay));
  const warmup_cosine cosine{.peak = o.lr, .min = o.min_lr, .warmup_steps = o.warmup, .total_steps = o.steps};
  auto lr_at = [&](std::int64_t step) { return o.schedule == "constant" ? o.lr : cosine(step); };

  std::int64_t first_step = 1;
  if (!o.resume.empty()) {
    const auto extra = load_checkpoint(rt, o.resume);
    first_step = std::stoll(extra.at("step")) + 1;
    opt.restore_step_count(std::stoll(extra.at("optimizer_steps")));
    if constexpr (std::is_same_v<Scaler, dynamic_loss_scaler>)
      opt.scaler().restore(std::stof(extra.at("loss_scale")), std::stoll(extra.at("clean_steps")));
    std::printf("resumed from %s at step %lld\n", o.resume.c_str(), static_cast<long long>(first_step - 1));
  }
  auto save = [&](std::int64_t step) {
    checkpoint_extra extra{{"step", std::to_string(step)},
                           {"optimizer_steps", std::to_string(opt.step_count())},
                           {"seed", std::to_string(o.seed)},
                           {"preset", o.preset},
                           {"precision", o.precision}};
    if constexpr (std::is_same_v<Scaler, dynamic_loss_scaler>) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(opt.loss_scale()));
      extra["loss_scale"] = buf;
      extra["clean_steps"] = std::to_string(opt.scaler().clean_steps());
    }
    save_checkpoint(rt, o.save, extra);
    std::printf("saved checkpoint to %s (step %lld)\n", o.save.c_str(), static_cast<long long>(step));
  };

  const std::size_t N = model.tokens_per_batch();
  std::vector<int> tokens(N), targets(N);
  auto validation_loss = [&] {
    auto eval = rt.untraced();  // evaluation is not part of the training trace
    double sum = 0;
    for (std::int64_t b = 0; b < o.val_batches; ++b) {
      gpt::fill_batch(data.val, o.seed, static_cast<std::uint64_t>(b), o.batch, o.seq, tokens.data(), targets.data());
      sum += model.loss(tokens.data(), targets.data());
    }
    return sum / static_cast<double>(o.val_batches);
  };

  // The training loop.
  using clock = std::chrono::steady_clock;
  const auto run_start = clock::now();
  double first_loss = 0, last_loss = 0, last_val = 0;
  std::int64_t skipped = 0;
  const std::int64_t last_step = o.stop_after > 0 ? std::min(o.stop_after, o.steps) : o.steps;
  for (std::int64_t step = first_step; step <= last_step; ++step) {
    const auto t0 = clock::now();
    const runtime_stats before = rt.stats();
    double loss = 0;
    for (int micro = 0; micro < o.accum; ++micro) {
      gpt::fill_batch(data.train, o.seed, gpt::train_key(step, micro), o.batch, o.seq, tokens.data(), targets.data());
      loss += model.forward_backward(tokens.data(), targets.data(), opt.loss_scale()) / o.accum;
    }
    const float lr = lr_at(step);
    const auto r = opt.step(rt, lr, o.accum);
    skipped += r.stepped ? 0 : 1;
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    const runtime_stats& s = rt.stats();
    if (step == first_step) first_loss = loss;
    last_loss = loss;
    std::printf("step %5lld/%lld | loss %.6f | %7.0f tok/s | lr %.2e | norm %6.3f%s | device %s / %s | host %s | "
                "moved %s | stall %.1f ms\n",
                static_cast<long long>(step), static_cast<long long>(o.steps), loss,
                static_cast<double>(N * static_cast<std::size_t>(o.accum)) / dt, static_cast<double>(lr), r.grad_norm,
                r.stepped ? "" : " (skipped: overflow)", format_bytes(device.usage().peak).c_str(),
                format_bytes(device_capacity).c_str(), format_bytes(rt.host_chunk_bytes()).c_str(),
                format_bytes(s.bytes_moved() - before.bytes_moved()).c_str(), 1e3 * (s.stall_s - before.stall_s));
    device.reset_peak();
    if (o.val_every > 0 && (step % o.val_every == 0 || step == last_step)) {
      last_val = validation_loss();
      std::printf("validation loss %.6f at step %lld\n", last_val, static_cast<long long>(step));
    }
    if (!o.save.empty() && ((o.save_every > 0 && step % o.save_every == 0) || step == last_step)) save(step);
    std::fflush(stdout);
  }

  // Summary, and a sample from the model.
  const double total = std::chrono::duration<double>(clock::now() - run_start).count();
  const runtime_stats& s = rt.stats();
  std::printf("\nsummary: %lld steps in %.1f s, loss %.4f -> %.4f, validation %.4f, %lld skipped\n",
              static_cast<long long>(last_step - first_step + 1), total, first_loss, last_loss, last_val,
              static_cast<long long>(skipped));
  std::printf("chunks: %s to device, %s to host, %llu loads (%llu prefetched, %llu hits), %llu evictions, "
              "%llu offloads, stall %.2f s; optimizer steps on device %llu, on host %llu\n",
              format_bytes(s.bytes_to_device).c_str(), format_bytes(s.bytes_to_host).c_str(),
              static_cast<unsigned long long>(s.loads), static_cast<unsigned long long>(s.prefetches),
              static_cast<unsigned long long>(s.prefetch_hits), static_cast<unsigned long long>(s.evictions),
              static_cast<unsigned long long>(s.offloads), s.stall_s, static_cast<unsigned long long>(s.device_steps),
              static_cast<unsigned long long>(s.host_steps));
  std::printf("peaks: chunks on device %s, non-model %s, device %s of %s; trace divergences %zu\n",
              format_bytes(s.peak_device_chunk_bytes).c_str(), format_bytes(s.peak_non_model_bytes).c_str(),
              format_bytes(device.usage().peak).c_str(), format_bytes(device_capacity).c_str(),
              rt.tracer().stats().divergences);
  if (o.sample > 0) {
    auto gen = rt.untraced();
    std::mt19937_64 rng(o.seed);
    std::vector<int> text{'T', 'h', 'e', ' '};
    for (int i = 0; i < o.sample; ++i) {
      const auto probs = model.next_token_probs(text);
      std::discrete_distribution<int> pick(probs.begin(), probs.end());
      text.push_back(pick(rng));
    }
    std::string out;
    for (int t : text) out += (t == '\n' || (t >= 32 && t < 127)) ? static_cast<char>(t) : '?';
    std::printf("\nsample:\n%s\n", out.c_str());
  }
  if (!o.trace.empty()) {
    rt.timeline_recorder().write_chrome_trace(o.trace);
    std::printf("timeline written to %s (open it in https://ui.perfetto.dev)\n", o.trace.c_str());
  }
  return 0;
}

template <class Scaler>
int with_policy(const options& o, const gpt::gpt_config& cfg) {
  using belady_rt = chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction>;
  using lru_rt = chunk_runtime<searched_chunk_layout, auto_placement, lru_eviction>;
  using static_rt = chunk_runtime<searched_chunk_layout, static_placement, belady_eviction>;
  if (o.policy == "patrickstar") return train<belady_rt, Scaler>(o, cfg, {});
  if (o.policy == "lru") return train<lru_rt, Scaler>(o, cfg, {});
  if (o.policy == "resident") return train<static_rt, Scaler>(o, cfg, static_placement::all_device());
  if (o.policy == "offload") return train<static_rt, Scaler>(o, cfg, static_placement::all_host());
  throw config_error("--policy '" + o.policy + "': use patrickstar (auto placement, Belady), lru (auto placement, "
                     "LRU), resident (everything on the device) or offload (optimizer and idle chunks on the host)");
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  CLI::App app{"train_gpt: a byte-level GPT whose model data lives in chunkstar chunks"};
  app.add_option("--data", o.data, "Text file to train on (default: the embedded corpus)");
  app.add_option("--preset", o.preset, "Model preset: tiny, mini, small, gpt2, 350m, 760m, 1.3b");
  app.add_option("--layers", o.layers, "Override the preset's number of blocks");
  app.add_option("--width", o.width, "Override the preset's width (channels)");
  app.add_option("--heads", o.heads, "Override the preset's attention heads");
  app.add_option("--context", o.context, "Override the preset's context length");
  app.add_option("--batch", o.batch, "Micro-batch size (sequences)");
  app.add_option("--seq", o.seq, "Sequence length (<= context)");
  app.add_option("--accum", o.accum, "Micro-batches accumulated per optimizer step");
  app.add_option("--steps", o.steps, "Optimizer steps (the schedule's length)");
  app.add_option("--stop-after", o.stop_after, "Stop after this step (to be resumed later); 0: run all --steps");
  app.add_option("--precision", o.precision, "fp32, bf16 or fp16 (dynamic loss scaling)");
  app.add_option("--policy", o.policy, "patrickstar, lru, resident or offload");
  app.add_option("--device-budget", o.device_budget, "Device memory, e.g. 256MiB; 'auto' = activations + 40% of the model data");
  app.add_option("--host-budget", o.host_budget, "Host memory for chunks, e.g. 4GiB, or 'unlimited'");
  app.add_option("--link-bandwidth", o.link_bandwidth, "Modelled host<->device bandwidth per second, e.g. 8GiB (0: memcpy speed)");
  app.add_option("--chunk-elems", o.chunk_elems, "Chunk size in elements (0: searched)");
  app.add_option("--prefetch", o.prefetch, "Most chunk loads in flight ahead of the next scope (0: prefetch off)");
  app.add_option("--lr", o.lr, "Peak learning rate");
  app.add_option("--min-lr", o.min_lr, "Final learning rate of the cosine schedule");
  app.add_option("--warmup", o.warmup, "Linear warm-up steps");
  app.add_option("--schedule", o.schedule, "cosine or constant");
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay (not on biases and norms)");
  app.add_option("--clip", o.clip, "Global gradient-norm clipping threshold (0: off)");
  app.add_option("--seed", o.seed, "Seed for initialisation, batches and sampling");
  app.add_option("--val-every", o.val_every, "Validation every N steps (0: never)");
  app.add_option("--val-batches", o.val_batches, "Validation batches");
  app.add_option("--save", o.save, "Directory to save checkpoints to (at the end, and every --save-every steps)");
  app.add_option("--save-every", o.save_every, "Save every N steps");
  app.add_option("--resume", o.resume, "Checkpoint directory to resume from");
  app.add_option("--trace", o.trace, "Write a Chrome-trace timeline (JSON) of memory and transfers");
  app.add_option("--sample", o.sample, "Bytes to generate at the end (0: none)");
  CLI11_PARSE(app, argc, argv);
  try {
    gpt::gpt_config cfg = gpt::parse_preset(o.preset);
    if (o.layers) cfg.layers = o.layers;
    if (o.width) cfg.width = o.width;
    if (o.heads) cfg.heads = o.heads;
    if (o.context) cfg.context = o.context;
    if (o.seq > static_cast<std::size_t>(cfg.context)) o.seq = static_cast<std::size_t>(cfg.context);
    gpt::validate(cfg);
    if (o.schedule != "cosine" && o.schedule != "constant") throw config_error("--schedule '" + o.schedule + "': use cosine or constant");
    return precision_type(o.precision) == dtype::f16 ? with_policy<dynamic_loss_scaler>(o, cfg)
                                                     : with_policy<static_loss_scaler>(o, cfg);
  } catch (const chunkstar::error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
