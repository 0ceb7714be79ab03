// SPDX-License-Identifier: Apache-2.0
// bench_disk: the disk tier against the disk's own limits, side by side in one run.
//
//  1. The limit: the disk's sequential O_DIRECT write and read bandwidth for chunk-sized blocks
//     (pwrite/pread, the best of 1 to --queue requests in flight, each its own aligned buffer),
//     and the disk engine moving the same blocks (its own overhead, beside the limit).
//  2. The runtime: the GPT trainer (train_gpt's model, AdamW) with a small device, a host budget
//     that holds a fraction of the model data, and the rest on the disk. Per iteration: the time,
//     the bytes read and written, the disk transfer time those bytes need at the limits
//     (read / read limit + written / write limit: one disk, reads and writes serialised), and the
//     compute time: the same run without the disk (the same device budget, the host unlimited),
//     measured in the same run (and everything resident, for reference).
//     achieved_gbs = disk bytes / iteration time; its ratio to the limit is disk_transfer_s /
//     iteration_s (target >= 0.8 where the run is disk-bound); iteration_s / max(compute_s,
//     disk_transfer_s) shows the overlap (target <= 1.15). The step needs forward+backward's
//     gradients and the next forward the step's parameters, so the two phases cannot overlap:
//     phase_bound_s = max(fb compute, fb disk) + max(step compute, step disk) is the bound the
//     runtime can reach, reported beside it. Each run is repeated with disk prefetch off
//     (demand_*) and with the step inside backward (chunk_adam::prepare; overlap_*, its compute
//     the no-disk run with it; --no-overlap-step: not). Every run must give the resident run's
//     losses bit for bit (exit 1 otherwise). --clip sets every run's clipping: a step that clipped
//     is not speculated, so the step inside backward is measured at --clip 0.
//  3. Scale: the deepest model of the preset's width that trains two steps within device, host and
//     disk budgets, against (device + host + disk) / 16 bytes per parameter (target >= 0.9).
// Table, JSON (--json) and a PNG (--plot, gnuplot). See docs/disk.md.
#include "bench_cli.hpp"
#include "disk_limits.hpp"
#include "e2e_support.hpp"

#include <chunkstar/config.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/disk/owned_disk_tier.hpp>
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <cstring>
#include <new>
#include <optional>
#include <thread>

using namespace chunkstar;

namespace {

struct options {
  std::string dir = "/var/tmp";
  std::string engine = "auto";  // uring, pool, auto
  std::string preset = "mini";
  std::size_t batch = 4, seq = 64;
  int warmup = 2, iters = 4;
  double device_fraction = 0.2;  // of the model data, beside the activations
  std::vector<double> host_fractions{0.5, 0.25};
  std::size_t limit_bytes = std::size_t{512} << 20;  // file the limit is measured over
  unsigned queue = 4;                                // requests in flight for the limit
  std::size_t scale_device = std::size_t{64} << 20, scale_host = std::size_t{64} << 20,
              scale_disk = std::size_t{512} << 20;
  std::size_t scale_batch = 1, scale_seq = 16;  // short sequences: activations are not model data
  std::size_t prefetch_depth = runtime_options{}.disk_prefetch_depth, horizon = runtime_options{}.disk_prefetch_horizon;
  std::string json, plot;
  bool quick = false;
  bool overlap = true;  // also each run with the step inside backward (chunk_adam::prepare)
  /// Every run's clipping (chunk_adam_options::max_grad_norm; 0: off). The step inside backward is
  /// speculative: where the last step clipped, chunk_adam::prepare does not speculate (it would be
  /// redone), so its rows measure it with clipping that does not bite (--clip 0).
  float clip = e2e::max_grad_norm;
};

using resident_runtime = chunk_runtime<searched_chunk_layout, static_placement, belady_eviction>;
using disk_runtime = chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction>;

/** The disk tier of --engine (io_uring where the kernel allows it for auto) over @p capacity bytes. */
std::unique_ptr<owned_disk_tier> open_disk(const options& o, std::size_t capacity) {
  try {
    return std::make_unique<owned_disk_tier>(
        disk_space_options{.directory = o.dir, .capacity = capacity, .name = "bench"},
        disk_engine_kind_named(o.engine));
  } catch (const config_error& e) {
    throw config_error("--engine " + o.engine + ": " + e.what());
  }
}
/** The engine's short name for the table. */
std::string engine_name(const owned_disk_tier& d) { return d.uses_uring() ? "uring" : "pool"; }

/** The GPT trainer of e2e::chunk_trainer with a disk tier attached (none when disk capacity is 0). */
template <class Runtime>
class disk_trainer {
 public:
  disk_trainer(const options& o, const gpt::gpt_config& c, gpt::batch_shape shape, std::size_t device, std::size_t host,
               std::size_t disk, searched_chunk_layout layout, typename Runtime::placement_type placement,
               runtime_options ro = {}, bool early = false)
      : early_(early),
        device_({.capacity = device, .name = "device"}),
        host_(
            {.capacity = host, .large_block_threshold = SIZE_MAX}),  // charged at their size, as the host budget counts
        rt_(device_, host_, copier_, ro, std::move(layout), std::move(placement)),
        model_(rt_, c, shape, e2e::model_seed),
        opt_({.hyper = {.weight_decay = e2e::weight_decay}, .max_grad_norm = o.clip},
             param_groups::with_default_decay(e2e::weight_decay)) {
    if (disk > 0) {
      disk_ = open_disk(o, disk);
      rt_.attach_disk(disk_->tier());
    }
    model_.finalize();
  }
  double step(const int* tokens, const int* targets) {
    const double loss = forward_backward(tokens, targets);
    optimizer_step();
    return loss;
  }
  double forward_backward(const int* tokens, const int* targets) {
    if (early_) (void)opt_.prepare(rt_, e2e::learning_rate);  // the step inside backward, the same bits
    return model_.forward_backward(tokens, targets);
  }
  void optimizer_step() {
    if (!opt_.step(rt_, e2e::learning_rate).stepped) throw state_error("an fp32 step was skipped (overflow)");
  }
  Runtime& runtime() { return rt_; }
  [[nodiscard]] std::string engine() const { return disk_ ? engine_name(*disk_) : "-"; }
  [[nodiscard]] copy_stats disk_stats() const { return disk_ ? disk_->stats() : copy_stats{}; }

 private:
  bool early_ = false;
  simulated_device_space device_;
  host_space host_;
  host_copy_engine copier_;
  std::unique_ptr<owned_disk_tier> disk_;  // before the runtime, which uses it
  Runtime rt_;
  gpt::chunked_gpt<Runtime> model_;
  chunk_adam<> opt_;
};

// --- 1. the limit -----------------------------------------------------------------------------------
/** The disk's limits (bench/disk_limits.hpp) and which engine moved the blocks. */
struct limits : bench::disk_limits {
  std::string engine;
};

limits measure_limits(const options& o, std::size_t block) {
  const std::size_t total = std::max(o.limit_bytes / block, std::size_t{4}) * block;
  const auto d = open_disk(o, total);
  limits l{bench::measure_disk_limits(*d, block, total, o.queue), engine_name(*d)};
  return l;
}

// --- 2. the runtime -----------------------------------------------------------------------------------
struct run_result {
  std::string name;
  double host_fraction = 0;
  std::size_t device = 0, host = 0, disk = 0, model = 0;
  double iteration_s = 0, compute_s = 0, disk_transfer_s = 0, achieved_gbs = 0, limit_gbs = 0;
  double read_bytes = 0, write_bytes = 0, disk_stall_s = 0, stall_s = 0;
  std::size_t peak_disk = 0, peak_host = 0;
  std::vector<double> losses;
  std::string engine;
  double demand_iteration_s = 0, demand_bytes = 0, demand_disk_stall_s = 0;  // disk prefetch off
  double read_busy_s = 0, write_busy_s = 0;                                  // the engine's lanes busy per iteration
  double resident_s = 0;                                                     // everything on the device
  double fb_s = 0, step_s = 0,
         fb_disk_s = 0;      // forward+backward and the step: time; disk time forward+backward needs at the limits
  double phase_bound_s = 0;  // max(fb compute, fb disk) + max(step compute, step disk)
  double early_steps = 0;    // chunks stepped inside backward per iteration
  // The same run with the step inside backward (chunk_adam::prepare): the iteration, its disk
  // bytes, its compute (the no-disk run with it too) and chunk steps inside backward.
  double overlap_iteration_s = 0, overlap_compute_s = 0, overlap_disk_s = 0, overlap_early = 0;
  double overlap_fb_s = 0, overlap_stall_s = 0;  // its forward+backward, its waits for the disk
};

template <class Trainer>
run_result time_run(const options& o, Trainer& tr, const limits& lim) {
  run_result r;
  e2e::batches data(o.batch, o.seq);
  std::vector<double> times, reads, writes, disk_stalls, stalls, read_busy, write_busy, fb_times, fb_bytes, early;
  const double lim_read = lim.read_gbs * 1e9, lim_write = lim.write_gbs * 1e9;
  for (int it = 1; it <= o.warmup + o.iters; ++it) {
    data.load(it);
    const runtime_stats before = tr.runtime().stats();
    const copy_stats busy_before = tr.disk_stats();
    const auto t0 = e2e::clock::now();
    r.losses.push_back(tr.forward_backward(data.tokens(), data.targets()));
    const double fb = e2e::seconds_since(t0);
    const runtime_stats mid = tr.runtime().stats();
    tr.optimizer_step();
    const double dt = e2e::seconds_since(t0);
    const copy_stats busy = tr.disk_stats();
    const runtime_stats& s = tr.runtime().stats();
    if (it <= o.warmup) continue;  // the first iteration traces; the next adopts the plan
    times.push_back(dt);
    fb_times.push_back(fb);
    fb_bytes.push_back(static_cast<double>(mid.bytes_from_disk - before.bytes_from_disk) / lim_read +
                       static_cast<double>(mid.bytes_to_disk - before.bytes_to_disk) / lim_write);
    reads.push_back(static_cast<double>(s.bytes_from_disk - before.bytes_from_disk));
    writes.push_back(static_cast<double>(s.bytes_to_disk - before.bytes_to_disk));
    disk_stalls.push_back(s.disk_stall_s - before.disk_stall_s);
    stalls.push_back(s.stall_s - before.stall_s);
    read_busy.push_back(busy[copy_direction::to_device].busy_s - busy_before[copy_direction::to_device].busy_s);
    write_busy.push_back(busy[copy_direction::to_host].busy_s - busy_before[copy_direction::to_host].busy_s);
    early.push_back(static_cast<double>(s.early_steps - before.early_steps));
  }
  r.early_steps = e2e::median(early);
  r.read_busy_s = e2e::median(read_busy);
  r.write_busy_s = e2e::median(write_busy);
  r.iteration_s = e2e::median(times);
  r.fb_s = e2e::median(fb_times);
  r.step_s = r.iteration_s - r.fb_s;
  r.fb_disk_s = e2e::median(fb_bytes);
  r.read_bytes = e2e::median(reads);
  r.write_bytes = e2e::median(writes);
  r.disk_stall_s = e2e::median(disk_stalls);
  r.stall_s = e2e::median(stalls);
  r.peak_disk = tr.runtime().stats().peak_disk_chunk_bytes;
  r.peak_host = tr.runtime().stats().peak_host_chunk_bytes;
  r.engine = tr.engine();
  return r;
}

// --- 3. scale -------------------------------------------------------------------------------------------
struct scale_result {
  std::size_t device = 0, host = 0, disk = 0;
  double limit_params = 0;
  std::size_t max_params = 0;
  gpt::gpt_config best{};
  double iteration_s = 0, read_bytes = 0, write_bytes = 0;
  int tried = 0;
};

scale_result search_scale(const options& o, const gpt::gpt_config& preset, const limits& lim) {
  scale_result r;
  r.device = o.scale_device;
  r.host = o.scale_host;
  r.disk = o.scale_disk;
  r.limit_params = static_cast<double>(r.device + r.host + r.disk) / 16.0;
  const auto member = [&](int layers) {
    gpt::gpt_config c = preset;
    c.layers = layers;
    return c;
  };
  const std::size_t base = gpt::param_count(member(1)), per_layer = gpt::param_count(member(2)) - base;
  int lo = 1, hi = static_cast<int>((r.limit_params - static_cast<double>(base)) / static_cast<double>(per_layer)) + 1;
  std::printf("\n== scale: device %s + host %s + disk %s: limit %.2f M parameters (16 bytes each); width %d ==\n",
              format_bytes(r.device).c_str(), format_bytes(r.host).c_str(), format_bytes(r.disk).c_str(),
              r.limit_params / 1e6, preset.width);
  std::printf("%7s %10s %8s %10s  %s\n", "layers", "params M", "/limit", "model MiB", "result");
  while (lo <= hi) {  // fitting is monotone in depth
    const int mid = lo + (hi - lo) / 2;
    const auto c = member(mid);
    const auto layout = e2e::trainer_layout(c);
    ++r.tried;
    std::string result = "trains";
    bool fits = false;
    try {
      disk_trainer<disk_runtime> tr(o, c, {o.scale_batch, o.scale_seq}, r.device, r.host, r.disk, layout, {});
      e2e::batches data(o.scale_batch, o.scale_seq);
      std::vector<double> times;
      runtime_stats before;
      for (int s = 1; s <= 2; ++s) {
        data.load(s);
        before = tr.runtime().stats();
        const auto t0 = e2e::clock::now();
        if (!std::isfinite(tr.step(data.tokens(), data.targets()))) throw state_error("non-finite loss");
        times.push_back(e2e::seconds_since(t0));
      }
      fits = true;
      if (gpt::param_count(c) > r.max_params) {
        r.max_params = gpt::param_count(c);
        r.best = c;
        r.iteration_s = times.back();
        r.read_bytes = static_cast<double>(tr.runtime().stats().bytes_from_disk - before.bytes_from_disk);
        r.write_bytes = static_cast<double>(tr.runtime().stats().bytes_to_disk - before.bytes_to_disk);
      }
    } catch (const out_of_memory_error& e) {
      result = std::string("out of memory: ") + e.what();
    } catch (const config_error& e) {
      result = std::string("config: ") + e.what();
    }
    std::printf("%7d %10.3f %8.3f %10s  %s\n", mid, static_cast<double>(gpt::param_count(c)) / 1e6,
                static_cast<double>(gpt::param_count(c)) / r.limit_params,
                e2e::mib(static_cast<double>(e2e::model_bytes(layout, c))).c_str(),
                result.substr(0, std::min<std::size_t>(result.find('\n'), 140)).c_str());
    std::fflush(stdout);
    if (fits) lo = mid + 1;
    else hi = mid - 1;
  }
  (void)lim;
  return r;
}

e2e::json_record base_record(const limits& l) {
  e2e::json_record j;
  j.num("disk_read_limit_gbs", l.read_gbs)
      .num("disk_write_limit_gbs", l.write_gbs)
      .num("block_bytes", static_cast<double>(l.block));
  j.num("engine_read_gbs", l.engine_read_gbs)
      .num("engine_write_gbs", l.engine_write_gbs)
      .boolean("o_direct", l.direct)
      .str("engine", l.engine);
  return j;
}

int write_plot(const options& o, const limits& l, const std::vector<run_result>& runs, const scale_result& sc) {
  std::string bw = "0 \"read limit\" " + std::to_string(l.read_gbs) + "\n1 \"write limit\" " +
                   std::to_string(l.write_gbs) + "\n2 \"engine read\" " + std::to_string(l.engine_read_gbs) +
                   "\n3 \"engine write\" " + std::to_string(l.engine_write_gbs) + "\n";
  std::string it;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    bw += std::to_string(4 + 2 * i) + " \"" + r.name + " limit\" " + std::to_string(r.limit_gbs) + "\n";
    bw += std::to_string(5 + 2 * i) + " \"" + r.name + " achieved\" " + std::to_string(r.achieved_gbs) + "\n";
    it += std::to_string(i) + " \"" + r.name + "\" " + std::to_string(r.iteration_s) + " " +
          std::to_string(r.compute_s) + " " + std::to_string(r.disk_transfer_s) + " " +
          std::to_string(r.phase_bound_s) + " " + std::to_string(r.overlap_iteration_s) + "\n";
  }
  const std::string scale = "0 \"limit\" " + std::to_string(sc.limit_params / 1e6) + "\n1 \"largest that trains\" " +
                            std::to_string(static_cast<double>(sc.max_params) / 1e6) + "\n";
  const std::string script =
      "set multiplot layout 1,3 title 'bench\\_disk: " + o.preset + ", batch " + std::to_string(o.batch) + "x" +
      std::to_string(o.seq) + ", engine " + l.engine + (l.direct ? ", O\\_DIRECT" : ", buffered") +
      "'\n"
      "set grid\nset style fill solid 0.5\nset boxwidth 0.7\nset yrange [0:*]\nset xtics rotate by -35\n"
      "set title 'disk bandwidth (GB/s)'\nplot '@DIR@/bw.dat' using 1:3:xtic(2) with boxes notitle\n"
      "set title 'iteration (s)'\nset boxwidth 0.16\nset key top left\n"
      "plot '@DIR@/it.dat' using ($1-0.32):3:xtic(2) with boxes title 'iteration', '@DIR@/it.dat' using ($1-0.16):7 "
      "with boxes title 'step inside backward', '@DIR@/it.dat' using ($1):4 with boxes title 'compute (no disk)', "
      "'@DIR@/it.dat' using ($1+0.16):5 with boxes title 'disk transfer', '@DIR@/it.dat' using ($1+0.32):6 with boxes "
      "title 'phase bound'\n"
      "set title 'scale (M parameters)'\nset boxwidth 0.6\nplot '@DIR@/scale.dat' using 1:3:xtic(2) with boxes "
      "notitle\n"
      "unset multiplot\n";
  return e2e::run_gnuplot("bench_disk", o.plot, script, {{"bw.dat", bw}, {"it.dat", it}, {"scale.dat", scale}},
                          "1500,520");
}

void usage() {
  std::printf(
      "usage: bench_disk [--dir DIR (/var/tmp)] [--engine auto|uring|pool] [--preset NAME (mini)] [--batch B (4)] "
      "[--seq T (64)]\n"
      "                  [--iters N (4)] [--device-fraction F (0.2)] [--host-fractions F,F (0.5,0.25)]\n"
      "                  [--limit-mib N (512)] [--queue N (4)] [--scale-device SIZE (64MiB)] [--scale-host SIZE "
      "(64MiB)]\n"
      "                  [--scale-disk SIZE (512MiB)] [--disk-prefetch N (8)] [--horizon N (2)] [--no-overlap-step] "
      "[--clip X (1)]\n"
      "                  [--json FILE] [--plot FILE.png] [--quick]\n");
}

std::size_t size_arg(const std::string& flag, const std::string& v) {
  const auto b = parse_bytes(v);
  if (!b || *b == 0) throw config_error(flag + " '" + v + "': write a size like 64MiB");
  return *b;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value (see --help)");
      return argv[++i];
    };
    if (a == "--quick") {  // a smoke test's defaults; options after it still apply
      o.quick = true;
      o.preset = "tiny";
      o.batch = 2;
      o.seq = 32;
      o.iters = 2;
      o.host_fractions = {0.3};
      o.limit_bytes = std::size_t{16} << 20;
      o.scale_device = std::size_t{2} << 20;
      o.scale_host = std::size_t{4} << 20;
      o.scale_disk = std::size_t{12} << 20;
    } else if (a == "--dir") o.dir = value();
    else if (a == "--engine") o.engine = value();
    else if (a == "--preset") o.preset = value();
    else if (a == "--batch") o.batch = std::stoul(value());
    else if (a == "--seq") o.seq = std::stoul(value());
    else if (a == "--iters") o.iters = std::stoi(value());
    else if (a == "--device-fraction") o.device_fraction = std::stod(value());
    else if (a == "--host-fractions") o.host_fractions = bench::parse_number_list(a, value());
    else if (a == "--limit-mib") o.limit_bytes = std::stoul(value()) << 20;
    else if (a == "--queue") o.queue = static_cast<unsigned>(std::stoul(value()));
    else if (a == "--scale-device") o.scale_device = size_arg(a, value());
    else if (a == "--scale-host") o.scale_host = size_arg(a, value());
    else if (a == "--scale-disk") o.scale_disk = size_arg(a, value());
    else if (a == "--json") o.json = value();
    else if (a == "--no-overlap-step") o.overlap = false;
    else if (a == "--clip") o.clip = std::stof(value());
    else if (a == "--disk-prefetch") o.prefetch_depth = std::stoul(value());
    else if (a == "--horizon") o.horizon = std::stoul(value());
    else if (a == "--plot") o.plot = value();
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      throw config_error("unknown option '" + a + "' (see --help)");
    }
  }
  if (o.engine != "auto" && o.engine != "uring" && o.engine != "pool")
    throw config_error("--engine '" + o.engine + "': use auto, uring or pool");
  if (o.iters < 1 || o.queue < 1) throw config_error("--iters and --queue must be at least 1");
  return o;
}

/** A run's name in the table: its host budget. */
std::string name_of(double host_fraction) {
  char name[64];
  std::snprintf(name, sizeof name, "host %.0f%%", 100 * host_fraction);
  return name;
}

}  // namespace

int main(int argc, char** argv) try {
  e2e::configure_process();
  const options o = parse(argc, argv);
  const gpt::gpt_config cfg = gpt::parse_preset(o.preset);
  const auto layout = e2e::trainer_layout(cfg);
  const std::size_t model = e2e::model_bytes(layout, cfg);
  const std::size_t act = e2e::activation_bytes(cfg, o.batch, o.seq);
  // A chunk as the disk tier moves it: whole 4 KiB blocks (chunk_store::footprint).
  const std::size_t chunk = (layout.plan(gpt::param_specs(cfg)).chunk_elems * sizeof(float) + 4095) / 4096 * 4096;

  // 1. The limit, for this model's chunks.
  const limits lim = measure_limits(o, chunk);
  std::printf("== the disk in %s (%s, %s), blocks of %s (one chunk), the best of 1 to %u in flight ==\n", o.dir.c_str(),
              lim.engine.c_str(), lim.direct ? "O_DIRECT" : "buffered", format_bytes(chunk).c_str(), o.queue);
  std::printf(
      "pwrite %.3f GB/s, pread %.3f GB/s (the limit); the disk engine: write %.3f GB/s (%.2f of it), read %.3f GB/s "
      "(%.2f of it)\n",
      lim.write_gbs, lim.read_gbs, lim.engine_write_gbs, lim.engine_write_gbs / lim.write_gbs, lim.engine_read_gbs,
      lim.engine_read_gbs / lim.read_gbs);

  // 2. Compute alone (everything resident), then the disk runs.
  std::printf("\n== %s (%zu parameters, model data %s in chunks of %s), batch %zux%zu ==\n", o.preset.c_str(),
              gpt::param_count(cfg), format_bytes(model).c_str(), format_bytes(chunk).c_str(), o.batch, o.seq);
  run_result resident;
  {
    disk_trainer<resident_runtime> tr(o, cfg, {o.batch, o.seq}, act + model + model / 8, SIZE_MAX, 0, layout,
                                      static_placement::all_device());
    resident = time_run(o, tr, lim);
  }
  // What the iteration costs without the disk: the same device budget, the host unlimited (chunks
  // still move between device and host, steps still run on the host): the disk tier's "compute".
  const std::size_t run_device = act + static_cast<std::size_t>(o.device_fraction * static_cast<double>(model));
  run_result no_disk, no_disk_overlap;
  {
    disk_trainer<disk_runtime> tr(o, cfg, {o.batch, o.seq}, run_device, SIZE_MAX, 0, layout, {});
    no_disk = time_run(o, tr, lim);
  }
  if (o.overlap) {  // and with the step inside backward: the compute those runs compare with
    disk_trainer<disk_runtime> tr(o, cfg, {o.batch, o.seq}, run_device, SIZE_MAX, 0, layout, {}, {}, true);
    no_disk_overlap = time_run(o, tr, lim);
  }
  std::printf(
      "resident (everything on the device): %.3f s per iteration; device %s and the host unlimited (no disk): %.3f s\n",
      resident.iteration_s, format_bytes(run_device).c_str(), no_disk.iteration_s);
  bool same_bits = no_disk.losses == resident.losses;
  std::vector<run_result> runs;
  for (double h : o.host_fractions) {
    const std::size_t device = run_device;
    const std::size_t host = std::max(static_cast<std::size_t>(h * static_cast<double>(model)), 8 * chunk);
    const std::size_t disk = model + 24 * chunk;
    disk_trainer<disk_runtime> tr(o, cfg, {o.batch, o.seq}, device, host, disk, layout, {},
                                  {.disk_prefetch_depth = o.prefetch_depth, .disk_prefetch_horizon = o.horizon});
    run_result r = time_run(o, tr, lim);
    {  // the same run with disk reads on demand only: what prefetch saves, and the bytes it adds
      disk_trainer<disk_runtime> demand_tr(o, cfg, {o.batch, o.seq}, device, host, disk, layout, {},
                                           {.disk_prefetch_depth = 0});
      const run_result d = time_run(o, demand_tr, lim);
      r.demand_iteration_s = d.iteration_s;
      r.demand_bytes = d.read_bytes + d.write_bytes;
      r.demand_disk_stall_s = d.disk_stall_s;
    }
    if (o.overlap) {  // the same run with the step inside backward (chunk_adam::prepare), the same bits
      disk_trainer<disk_runtime> early_tr(o, cfg, {o.batch, o.seq}, device, host, disk, layout, {},
                                          {.disk_prefetch_depth = o.prefetch_depth, .disk_prefetch_horizon = o.horizon},
                                          true);
      const run_result e = time_run(o, early_tr, lim);
      r.overlap_iteration_s = e.iteration_s;
      r.overlap_compute_s = no_disk_overlap.iteration_s;
      r.overlap_disk_s = e.read_bytes / (lim.read_gbs * 1e9) + e.write_bytes / (lim.write_gbs * 1e9);
      r.overlap_early = e.early_steps;
      r.overlap_fb_s = e.fb_s;
      r.overlap_stall_s = e.disk_stall_s;
      if (e.losses != resident.losses || no_disk_overlap.losses != resident.losses) {
        same_bits = false;
        std::fprintf(stderr,
                     "bench_disk: %s with the step inside backward: the losses differ from the resident run's\n",
                     name_of(h).c_str());
      }
    }
    const std::string name = name_of(h);
    r.name = name;
    r.host_fraction = h;
    r.device = device;
    r.host = host;
    r.disk = disk;
    r.model = model;
    r.compute_s = no_disk.iteration_s;
    r.resident_s = resident.iteration_s;
    r.disk_transfer_s = r.read_bytes / (lim.read_gbs * 1e9) + r.write_bytes / (lim.write_gbs * 1e9);
    // The step needs forward+backward's gradients and the next forward needs the step's
    // parameters: the two phases cannot overlap each other, only what runs within each.
    r.phase_bound_s = std::max(no_disk.fb_s, r.fb_disk_s) + std::max(no_disk.step_s, r.disk_transfer_s - r.fb_disk_s);
    r.achieved_gbs = (r.read_bytes + r.write_bytes) / r.iteration_s / 1e9;
    r.limit_gbs = r.disk_transfer_s > 0 ? (r.read_bytes + r.write_bytes) / r.disk_transfer_s / 1e9 : 0;
    if (r.losses != resident.losses) {
      same_bits = false;
      std::fprintf(stderr,
                   "bench_disk: %s: the losses differ from the resident run's (the same-bits invariant is broken)\n",
                   name.c_str());
    }
    runs.push_back(r);
  }
  std::printf("%-9s %9s %9s %9s %9s %9s %9s %9s %9s %8s %9s %8s %9s %9s %8s %9s\n", "run", "device", "host",
              "disk peak", "read MiB", "write MiB", "iter s", "compute s", "disk s", "achieved", "GB/s lim", "ach/lim",
              "it/bound", "demand s", "B/dem", "stall s");
  for (const auto& r : runs) {
    std::printf("%-9s %9s %9s %9s %9s %9s %9.3f %9.3f %9.3f %8.3f %9.3f %8.2f %9.2f %9.3f %8.2f %9.3f\n",
                r.name.c_str(), e2e::mib(static_cast<double>(r.device)).c_str(),
                e2e::mib(static_cast<double>(r.host)).c_str(), e2e::mib(static_cast<double>(r.peak_disk)).c_str(),
                e2e::mib(r.read_bytes).c_str(), e2e::mib(r.write_bytes).c_str(), r.iteration_s, r.compute_s,
                r.disk_transfer_s, r.achieved_gbs, r.limit_gbs, r.limit_gbs > 0 ? r.achieved_gbs / r.limit_gbs : 0.0,
                r.iteration_s / std::max(r.compute_s, r.disk_transfer_s), r.demand_iteration_s,
                r.demand_bytes > 0 ? (r.read_bytes + r.write_bytes) / r.demand_bytes : 0.0, r.disk_stall_s);
    std::printf(
        "%-9s   disk lanes busy per iteration: reads %.3f s, writes %.3f s (%.0f%% and %.0f%% of it); forward+backward "
        "%.3f s "
        "(without the disk %.3f, its disk %.3f), step %.3f s (without %.3f, its disk %.3f: %.2f of the limit while it "
        "runs): "
        "iteration / phase bound %.2f\n",
        "", r.read_busy_s, r.write_busy_s, 100 * r.read_busy_s / r.iteration_s, 100 * r.write_busy_s / r.iteration_s,
        r.fb_s, no_disk.fb_s, r.fb_disk_s, r.step_s, no_disk.step_s, r.disk_transfer_s - r.fb_disk_s,
        (r.disk_transfer_s - r.fb_disk_s) / r.step_s, r.iteration_s / r.phase_bound_s);
    if (o.overlap)
      std::printf(
          "%-9s   the step inside backward: iteration %.3f s (forward+backward %.3f, step %.3f; %.0f chunk "
          "steps inside backward; disk stalls %.3f s), compute %.3f s (no disk, the same), disk %.3f s: iteration "
          "/ max(compute, disk) %.2f (the step after backward: %.2f)\n",
          "", r.overlap_iteration_s, r.overlap_fb_s, r.overlap_iteration_s - r.overlap_fb_s, r.overlap_early,
          r.overlap_stall_s, r.overlap_compute_s, r.overlap_disk_s,
          r.overlap_iteration_s / std::max(std::min(r.compute_s, r.overlap_compute_s), r.overlap_disk_s),
          r.iteration_s / std::max(r.compute_s, r.disk_transfer_s));
  }
  std::printf(
      "(MiB columns: per iteration; disk s = read / read limit + written / write limit; ach/lim = achieved / limit, "
      "meaningful where disk s > compute s; compute s: the same run without a disk (host unlimited); it/bound = "
      "iteration / max(compute, disk); demand s, B/dem: the iteration and "
      "the disk bytes against the same run with disk prefetch off; stall s: waits for the disk per iteration)\n");
  std::printf("same bits as the resident run: %s\n", same_bits ? "yes" : "NO");

  // 3. Scale.
  const scale_result sc = search_scale(o, cfg, lim);
  std::printf("largest: %d layers, %.3f M parameters = %.1f%% of the limit (%.3f M)\n", sc.best.layers,
              static_cast<double>(sc.max_params) / 1e6, 100 * static_cast<double>(sc.max_params) / sc.limit_params,
              sc.limit_params / 1e6);

  if (!o.json.empty()) {
    std::vector<e2e::json_record> recs;
    for (const auto& r : runs) {
      auto j = base_record(lim);
      j.str("kind", "run").str("name", r.name).num("host_fraction", r.host_fraction);
      j.num("device_bytes", static_cast<double>(r.device))
          .num("host_bytes", static_cast<double>(r.host))
          .num("disk_bytes", static_cast<double>(r.disk));
      j.num("model_bytes", static_cast<double>(r.model))
          .num("iteration_s", r.iteration_s)
          .num("compute_s", r.compute_s);
      j.num("disk_transfer_s", r.disk_transfer_s).num("achieved_gbs", r.achieved_gbs).num("limit_gbs", r.limit_gbs);
      j.num("read_bytes", r.read_bytes)
          .num("write_bytes", r.write_bytes)
          .num("disk_stall_s", r.disk_stall_s)
          .num("stall_s", r.stall_s);
      j.num("peak_disk_chunk_bytes", static_cast<double>(r.peak_disk))
          .num("peak_host_chunk_bytes", static_cast<double>(r.peak_host));
      j.boolean("same_bits", r.losses == resident.losses);
      j.num("step_achieved_over_limit", (r.disk_transfer_s - r.fb_disk_s) / r.step_s);
      j.num("phase_bound_s", r.phase_bound_s).num("forward_backward_s", r.fb_s).num("step_s", r.step_s);
      j.num("resident_s", r.resident_s).num("read_busy_s", r.read_busy_s).num("write_busy_s", r.write_busy_s);
      j.num("demand_iteration_s", r.demand_iteration_s)
          .num("demand_bytes", r.demand_bytes)
          .num("demand_disk_stall_s", r.demand_disk_stall_s);
      if (o.overlap)
        j.num("overlap_iteration_s", r.overlap_iteration_s)
            .num("overlap_compute_s", r.overlap_compute_s)
            .num("overlap_disk_transfer_s", r.overlap_disk_s)
            .num("overlap_early_steps", r.overlap_early)
            .num("overlap_forward_backward_s", r.overlap_fb_s)
            .num("overlap_disk_stall_s", r.overlap_stall_s);
      j.num("disk_prefetch_depth", static_cast<double>(o.prefetch_depth))
          .num("disk_prefetch_horizon", static_cast<double>(o.horizon));
      recs.push_back(j);
    }
    auto j = base_record(lim);
    const double transfer = sc.read_bytes / (lim.read_gbs * 1e9) + sc.write_bytes / (lim.write_gbs * 1e9);
    j.str("kind", "scale")
        .num("device_bytes", static_cast<double>(sc.device))
        .num("host_bytes", static_cast<double>(sc.host));
    j.num("disk_bytes", static_cast<double>(sc.disk))
        .num("max_params", static_cast<double>(sc.max_params))
        .num("limit_params", sc.limit_params);
    j.num("layers", sc.best.layers)
        .num("iteration_s", sc.iteration_s)
        .num("compute_s", 0)
        .num("disk_transfer_s", transfer);
    j.num("achieved_gbs", sc.iteration_s > 0 ? (sc.read_bytes + sc.write_bytes) / sc.iteration_s / 1e9 : 0);
    recs.push_back(j);
    e2e::write_json(o.json, recs);
  }
  if (!o.plot.empty()) write_plot(o, lim, runs, sc);
  return same_bits ? 0 : 1;
} catch (const chunkstar::error& e) {
  std::fprintf(stderr, "bench_disk: %s\n", e.what());
  return 2;
}
