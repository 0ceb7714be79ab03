// SPDX-License-Identifier: Apache-2.0
// bench_scale: the largest GPT-shaped model that trains within given device and host budgets.
//
// For each (device budget, host budget) pair, searches models of the preset's family (its head
// width, so heads = width / head width; its vocabulary and context) over width and depth for the
// largest parameter count that trains three steps (forward, backward, AdamW) without error, and
// compares it with the limit (device + host budget) / (bytes of model data per parameter): 16 for
// fp32 params with Adam (param 4 + grad 4 + momentum 4 + variance 4). A model "does not fit" when
// the runtime throws out_of_memory_error or config_error. See docs/performance.md.
#include "e2e_support.hpp"

#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/placement/auto_placement.hpp>

#include <cmath>
#include <map>

using namespace chunkstar;

namespace {

struct options {
  std::vector<std::size_t> device_budgets{std::size_t{64} << 20};
  std::vector<std::size_t> host_budgets{std::size_t{256} << 20};
  std::string preset = "small";
  std::size_t batch = 1, seq = 16;  // short sequences: activations are not model data, keep them small
  int steps = 3;
  std::string layout = "page";  // page: chunk sizes in whole 2 MiB pages; trainer: train_gpt's search
  bool all_widths = true;       // false: the preset's width only (depth searched)
  std::string json, plot;
  bool quick = false;
};

/** Bytes of model data per parameter: fp32 param, grad, momentum and variance. */
constexpr double bytes_per_param = 16;

/** The host space accounts blocks of 2 MiB and more in whole 2 MiB pages; chunk sizes that are
 *  whole pages waste nothing there. Candidate sizes: multiples of 512 Ki fp32 elements (2 MiB) from
 *  the largest tensor up to 8 pages more, keeping the one whose packing wastes least. */
searched_chunk_layout make_layout(const options& o, const gpt::gpt_config& c) {
  if (o.layout == "trainer") return e2e::trainer_layout(c);
  const std::size_t page = host_space::huge_page_bytes / sizeof(float);
  const std::size_t lo = (e2e::largest_tensor(c) + page - 1) / page * page;
  return searched_chunk_layout(
      {.min_chunk_elems = lo, .max_chunk_elems = lo + 8 * page, .step_elems = page, .align_elems = 32});
}

struct trial {
  gpt::gpt_config config{};
  std::size_t params = 0;
  bool fits = false;
  std::string error;  // first line of the typed error when it does not fit
  std::size_t model_bytes = 0, chunk_bytes = 0, num_chunks = 0;
  double waste = 0;
  std::size_t device_peak = 0, host_peak = 0, non_model_peak = 0;
  double seconds = 0;
};

using scale_runtime = chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction>;

trial try_model(const gpt::gpt_config& c, const options& o, std::size_t device, std::size_t host) {
  trial t;
  t.config = c;
  t.params = gpt::param_count(c);
  const auto layout = make_layout(o, c);
  const auto plan = layout.plan(gpt::param_specs(c));
  t.chunk_bytes = plan.chunk_elems * sizeof(float);
  t.num_chunks = plan.num_chunks;
  t.waste = plan.waste_fraction();
  t.model_bytes = e2e::model_bytes(layout, c);
  const auto t0 = e2e::clock::now();
  try {
    auto tr = std::make_unique<e2e::chunk_trainer<scale_runtime>>(
        c, gpt::batch_shape{o.batch, o.seq}, e2e::trainer_memory{.device_capacity = device, .host_capacity = host},
        runtime_options{}, layout, auto_placement{});
    e2e::batches data(o.batch, o.seq);
    for (int s = 1; s <= o.steps; ++s) {
      data.load(s);
      const double loss = tr->step(data.tokens(), data.targets());
      if (!std::isfinite(loss)) throw state_error("non-finite loss while training");
    }
    t.fits = true;
    t.device_peak = tr->device().peak();
    t.host_peak = tr->host().usage().peak;
    t.non_model_peak = tr->runtime().stats().peak_non_model_bytes;
    if (t.device_peak > device || t.host_peak > host) throw state_error("a space went over its capacity");
  } catch (const out_of_memory_error& e) {
    t.error = std::string("out_of_memory_error: ") + e.what();
  } catch (const config_error& e) {
    t.error = std::string("config_error: ") + e.what();
  }
  t.seconds = e2e::seconds_since(t0);
  return t;
}

struct search_result {
  std::size_t device = 0, host = 0;
  double limit_params = 0;
  trial best;                 // the largest model that trained
  std::vector<trial> trials;  // every model tried
};

/** Parameters of the preset family at @p layers and @p heads (width = heads x head width). */
gpt::gpt_config family_member(const gpt::gpt_config& preset, int layers, int heads) {
  gpt::gpt_config c = preset;
  c.width = heads * (preset.width / preset.heads);
  c.heads = heads;
  c.layers = layers;
  return c;
}

search_result search(const gpt::gpt_config& preset, const options& o, std::size_t device, std::size_t host) {
  search_result r;
  r.device = device;
  r.host = host;
  r.limit_params = static_cast<double>(device + host) / bytes_per_param;
  // For each head count, the deepest model whose parameters stay within the limit (an upper bound:
  // model data is at least 16 bytes per parameter). Try the candidates largest first; below the
  // current best nothing can win, so stop there.
  struct candidate {
    int heads, layers;
    std::size_t params;
  };
  std::vector<candidate> cands;
  for (int h = o.all_widths ? 1 : preset.heads; o.all_widths || h == preset.heads; ++h) {
    const auto one = family_member(preset, 1, h), two = family_member(preset, 2, h);
    const std::size_t base = gpt::param_count(one), per_layer = gpt::param_count(two) - base;
    if (static_cast<double>(base) > r.limit_params) break;
    const int layers =
        static_cast<int>((r.limit_params - static_cast<double>(base)) / static_cast<double>(per_layer)) + 1;
    cands.push_back({h, layers, gpt::param_count(family_member(preset, layers, h))});
  }
  // The preset's own width first (a good lower bound early prunes most other widths), then the rest
  // by their upper bound.
  std::sort(cands.begin(), cands.end(), [&](const candidate& a, const candidate& b) {
    if ((a.heads == preset.heads) != (b.heads == preset.heads)) return a.heads == preset.heads;
    return a.params > b.params;
  });
  std::printf("\n== device %s, host %s: limit %.2f M parameters (%.0f bytes of model data each) ==\n",
              format_bytes(device).c_str(), format_bytes(host).c_str(), r.limit_params / 1e6, bytes_per_param);
  std::printf("%6s %6s %6s %10s %8s %10s %8s %7s %10s %10s  %s\n", "layers", "width", "heads", "params M", "/limit",
              "model MiB", "chunk MiB", "waste", "dev peak", "host peak", "result");
  auto report = [&](const trial& t) {
    const auto& c = t.config;
    std::printf("%6d %6d %6d %10.3f %8.3f %10s %8s %6.1f%% %10s %10s  %s\n", c.layers, c.width, c.heads,
                static_cast<double>(t.params) / 1e6, static_cast<double>(t.params) / r.limit_params,
                e2e::mib(static_cast<double>(t.model_bytes)).c_str(),
                e2e::mib(static_cast<double>(t.chunk_bytes)).c_str(), 100 * t.waste,
                t.fits ? e2e::mib(static_cast<double>(t.device_peak)).c_str() : "-",
                t.fits ? e2e::mib(static_cast<double>(t.host_peak)).c_str() : "-",
                t.fits ? "trains" : t.error.substr(0, std::min<std::size_t>(t.error.find('\n'), 160)).c_str());
    std::fflush(stdout);
  };
  for (const auto& cand : cands) {
    if (r.best.fits && cand.params <= r.best.params) continue;  // cannot beat the best
    // Binary search over depth (fitting is monotone in depth): the deepest model of this width that
    // trains, among those larger than the best so far.
    int lo = 1, hi = cand.layers;
    while (r.best.fits && lo <= hi && gpt::param_count(family_member(preset, lo, cand.heads)) <= r.best.params) ++lo;
    while (lo <= hi) {
      const int mid = lo + (hi - lo) / 2;
      trial t = try_model(family_member(preset, mid, cand.heads), o, device, host);
      report(t);
      r.trials.push_back(t);
      if (t.fits) {
        if (!r.best.fits || t.params > r.best.params) r.best = t;
        lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
  }
  if (!r.best.fits) {
    std::printf("nothing in the family trains within these budgets\n");
  } else {
    const auto& b = r.best;
    std::printf(
        "largest: %d layers x width %d (%d heads): %.3f M parameters = %.1f%% of the limit; model data %s MiB "
        "(%.1f%% of device + host), peak non-model %s MiB\n",
        b.config.layers, b.config.width, b.config.heads, static_cast<double>(b.params) / 1e6,
        100 * static_cast<double>(b.params) / r.limit_params, e2e::mib(static_cast<double>(b.model_bytes)).c_str(),
        100 * static_cast<double>(b.model_bytes) / static_cast<double>(device + host),
        e2e::mib(static_cast<double>(b.non_model_peak)).c_str());
  }
  return r;
}

int write_plot(const options& o, const std::vector<search_result>& results) {
  std::string fits, fails, limits;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    char buf[200];
    std::snprintf(buf, sizeof buf, "%zu \"%s+%s\" %.4f %.4f %.4f\n", i, format_bytes(r.device).c_str(),
                  format_bytes(r.host).c_str(), r.limit_params / 1e6,
                  r.best.fits ? static_cast<double>(r.best.params) / 1e6 : 0.0,
                  static_cast<double>(r.host) / bytes_per_param / 1e6);
    limits += buf;
    for (const auto& t : r.trials) {
      std::snprintf(buf, sizeof buf, "%zu %.4f\n", i, static_cast<double>(t.params) / 1e6);
      (t.fits ? fits : fails) += buf;
    }
  }
  std::string script =
      "set grid\nset title 'bench\\_scale: largest GPT (" + o.preset + " family) that trains 3 steps, batch " +
      std::to_string(o.batch) + "x" + std::to_string(o.seq) + ", " + o.layout +
      " layout'\nset ylabel 'parameters (M)'\nset xlabel 'device + host budget'\nset key top left\n"
      "set xrange [-0.5:" +
      std::to_string(results.size() - 0.5) +
      "]\nset yrange [0:*]\nset boxwidth 0.22\n"
      "set style fill solid 0.4\n"
      "plot '@DIR@/limits.dat' using ($1-0.25):3:xtic(2) with boxes title 'limit (device+host)/16 B', "
      "'@DIR@/limits.dat' using ($1):5 with boxes title 'host/16 B', "
      "'@DIR@/limits.dat' using ($1+0.25):4 with boxes title 'largest that trains', "
      "'@DIR@/limits.dat' using ($1+0.25):4:(sprintf('%.0f%%', 100*$4/$3)) with labels offset 0,1 notitle";
  std::vector<std::pair<std::string, std::string>> files{{"limits.dat", limits}};
  if (!fits.empty()) {
    files.emplace_back("fits.dat", fits);
    script += ", '@DIR@/fits.dat' using ($1+0.42):2 with points pt 7 lc rgb 'dark-green' title 'tried: trains'";
  }
  if (!fails.empty()) {
    files.emplace_back("fails.dat", fails);
    script += ", '@DIR@/fails.dat' using ($1+0.42):2 with points pt 2 lc rgb 'red' title 'tried: out of memory'";
  }
  script += "\n";
  return e2e::run_gnuplot("bench_scale", o.plot, script, files, "900,560");
}

void usage() {
  std::printf(
      "usage: bench_scale [--device-budget SIZES (64MiB)] [--host-budget SIZES (256MiB)] [--preset NAME (small)]\n"
      "                   [--batch B (1)] [--seq T (16)] [--steps N (3)] [--layout page|trainer]\n"
      "                   [--widths all|preset (all: every width of the family; preset: its own)]\n"
      "                   [--json FILE] [--plot FILE.png] [--quick]\n"
      "SIZES: comma-separated, e.g. 128MiB,256MiB; every device budget is paired with every host budget.\n");
}

std::vector<std::size_t> parse_sizes(const std::string& flag, const std::string& list) {
  std::vector<std::size_t> out;
  for (std::size_t at = 0; at <= list.size();) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const auto b = parse_bytes(list.substr(at, comma - at));
    if (!b || *b == 0) throw config_error(flag + " '" + list + "': write sizes like 64MiB or 1.5GiB, comma-separated");
    out.push_back(*b);
    at = comma + 1;
  }
  return out;
}

options parse(int argc, char** argv) {
  options o;
  bool device_set = false, host_set = false, preset_set = false, layout_set = false, widths_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value (see --help)");
      return argv[++i];
    };
    if (a == "--quick") o.quick = true;
    else if (a == "--device-budget") o.device_budgets = parse_sizes(a, value()), device_set = true;
    else if (a == "--host-budget") o.host_budgets = parse_sizes(a, value()), host_set = true;
    else if (a == "--preset") o.preset = value(), preset_set = true;
    else if (a == "--batch") o.batch = std::stoul(value());
    else if (a == "--seq") o.seq = std::stoul(value());
    else if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--layout") o.layout = value(), layout_set = true;
    else if (a == "--widths") {
      const std::string w = value();
      if (w != "all" && w != "preset") throw config_error("--widths '" + w + "': use all or preset");
      o.all_widths = w == "all";
      widths_set = true;
    } else if (a == "--json") o.json = value();
    else if (a == "--plot") o.plot = value();
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      usage();
      throw config_error("unknown argument '" + a + "'");
    }
  }
  if (o.quick) {  // the tiny family in a few MiB: the CTest smoke run (2 MiB pages would be too coarse)
    if (!preset_set) o.preset = "tiny";
    if (!device_set) o.device_budgets = {std::size_t{4} << 20};
    if (!host_set) o.host_budgets = {std::size_t{8} << 20};
    if (!layout_set) o.layout = "trainer";
    if (!widths_set) o.all_widths = false;
  }
  if (o.layout != "page" && o.layout != "trainer")
    throw config_error("--layout '" + o.layout + "': use page or trainer");
  if (o.steps < 1 || o.batch < 1 || o.seq < 1) throw config_error("need --steps, --batch and --seq >= 1");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  e2e::configure_process();  // before any OpenMP region: passive OpenMP waiting, caching heap
  const options o = parse(argc, argv);
  const gpt::gpt_config preset = gpt::parse_preset(o.preset);
  std::printf(
      "bench_scale: %s family (head width %d, vocabulary %d, context %d), batch %zu x %zu, %d steps, "
      "%s layout, auto placement + Belady, prefetch 2\n",
      o.preset.c_str(), preset.width / preset.heads, preset.vocab, preset.context, o.batch, o.seq, o.steps,
      o.layout.c_str());
  std::vector<search_result> results;
  std::vector<e2e::json_record> records;
  for (std::size_t d : o.device_budgets) {
    for (std::size_t h : o.host_budgets) {
      const auto r = search(preset, o, d, h);
      results.push_back(r);
      e2e::json_record j;
      j.str("benchmark", "scale")
          .num("device_budget", static_cast<double>(d))
          .num("host_budget", static_cast<double>(h));
      j.num("max_params", r.best.fits ? static_cast<double>(r.best.params) : 0).num("limit_params", r.limit_params);
      j.num("ratio", r.best.fits ? static_cast<double>(r.best.params) / r.limit_params : 0);
      j.num("bytes_per_param", bytes_per_param).str("preset", o.preset).str("layout", o.layout);
      j.num("batch", static_cast<double>(o.batch)).num("seq", static_cast<double>(o.seq)).num("steps", o.steps);
      if (r.best.fits) {
        j.num("layers", r.best.config.layers).num("width", r.best.config.width).num("heads", r.best.config.heads);
        j.num("model_bytes", static_cast<double>(r.best.model_bytes))
            .num("chunk_bytes", static_cast<double>(r.best.chunk_bytes));
        j.num("layout_waste", r.best.waste).num("device_peak", static_cast<double>(r.best.device_peak));
        j.num("host_peak", static_cast<double>(r.best.host_peak))
            .num("non_model_peak", static_cast<double>(r.best.non_model_peak));
      }
      std::string tried;
      for (const auto& t : r.trials)
        tried += (tried.empty() ? "" : "; ") + std::to_string(t.config.layers) + "x" + std::to_string(t.config.width) +
                 " " + std::to_string(t.params) + (t.fits ? " trains" : " " + t.error.substr(0, t.error.find(':')));
      j.str("trials", tried);
      records.push_back(j);
    }
  }
  if (!o.json.empty()) e2e::write_json(o.json, records);
  if (!o.plot.empty()) return write_plot(o, results);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_scale: %s\n", e.what());
  return 1;
}
