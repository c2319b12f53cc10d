// Several llama.cpp builds in one process, decode calls of n rows timed build after build (scripts/
// bench-kernels.sh builds and runs it). Each build's libllama is loaded into a namespace of its own
// (dlmopen), so it finds its own libggml; all run the same model with the same settings, and calls of
// every size alternate between the builds round by round, so that a VM's drift (here: up to +-20 % between
// runs minutes apart) falls on every build alike. Separate processes per build could not compare within a
// few per cent.
// usage: kernel-ab MODEL THREADS ROUNDS DEPTH ROWS(comma list) LIB_DIR[@TILED_START]...  (DEPTH + 48 <= 4096)
// prints a Markdown table: per call size, each build's median ms per call (fastest of 3 per round) and the
// median over rounds of its time / the first build's. @T sets GGML_CPU_TILED_MM_MIN_BATCH for that build.
#include <dlfcn.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "llama.h"

struct Api {
    decltype(&llama_backend_init) backend_init;
    decltype(&llama_model_default_params) model_default_params;
    decltype(&llama_model_load_from_file) model_load;
    decltype(&llama_context_default_params) context_default_params;
    decltype(&llama_init_from_model) init_from_model;
    decltype(&llama_batch_init) batch_init;
    decltype(&llama_decode) decode;
    decltype(&llama_get_memory) get_memory;
    decltype(&llama_memory_seq_rm) seq_rm;
    decltype(&llama_synchronize) synchronize;
    decltype(&llama_get_logits_ith) logits_ith;
    llama_context * ctx;
    llama_memory_t mem;
    llama_batch batch;
};

template <typename T> static void sym(void * h, const char * name, T & out) {
    out = (T) dlsym(h, name);
    if (!out) { fprintf(stderr, "missing %s: %s\n", name, dlerror()); exit(1); }
}

static double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void fill(Api & a, const std::vector<int> & toks, int pos0, bool all_logits) {
    a.batch.n_tokens = (int) toks.size();
    for (size_t i = 0; i < toks.size(); i++) {
        a.batch.token[i] = toks[i];
        a.batch.pos[i] = pos0 + (int) i;
        a.batch.n_seq_id[i] = 1;
        a.batch.seq_id[i][0] = 0;
        a.batch.logits[i] = all_logits || i + 1 == toks.size();
    }
}

int main(int argc, char ** argv) {
    if (argc < 7) { fprintf(stderr, "usage: kernel-ab MODEL THREADS ROUNDS DEPTH ROWS LIB_DIR[@T]...\n"); return 2; }
    const char * model = argv[1];
    int threads = atoi(argv[2]), rounds = atoi(argv[3]), depth = atoi(argv[4]);
    std::vector<int> rows;
    for (char * p = strtok(argv[5], ","); p; p = strtok(nullptr, ",")) rows.push_back(atoi(p));
    std::vector<std::string> dirs(argv + 6, argv + argc);
    std::vector<Api> apis(dirs.size());
    for (size_t b = 0; b < dirs.size(); b++) {
        // DIR@T: this build with GGML_CPU_TILED_MM_MIN_BATCH=T (read once, at its first matrix product)
        std::string dir = dirs[b];
        size_t at = dir.find('@');
        if (at != std::string::npos) { setenv("GGML_CPU_TILED_MM_MIN_BATCH", dir.substr(at + 1).c_str(), 1); dir = dir.substr(0, at); }
        else { unsetenv("GGML_CPU_TILED_MM_MIN_BATCH"); }
        std::string path = dir + "/libllama.so";
        void * h = dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        Api & a = apis[b];
        sym(h, "llama_backend_init", a.backend_init);
        sym(h, "llama_model_default_params", a.model_default_params);
        sym(h, "llama_model_load_from_file", a.model_load);
        sym(h, "llama_context_default_params", a.context_default_params);
        sym(h, "llama_init_from_model", a.init_from_model);
        sym(h, "llama_batch_init", a.batch_init);
        sym(h, "llama_decode", a.decode);
        sym(h, "llama_get_memory", a.get_memory);
        sym(h, "llama_memory_seq_rm", a.seq_rm);
        sym(h, "llama_synchronize", a.synchronize);
        sym(h, "llama_get_logits_ith", a.logits_ith);
        a.backend_init();
        llama_model_params mp = a.model_default_params();
        llama_model * m = a.model_load(model, mp);
        if (!m) { fprintf(stderr, "load failed\n"); return 1; }
        llama_context_params cp = a.context_default_params();
        cp.n_ctx = 4096; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = 1;
        cp.n_threads = threads; cp.n_threads_batch = threads; cp.no_perf = true;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;  // as specserve and llama-server
        a.ctx = a.init_from_model(m, cp);
        a.mem = a.get_memory(a.ctx);
        a.batch = a.batch_init(512, 0, 1);
        std::vector<int> one = {100};
        fill(a, one, 0, true);
        a.decode(a.ctx, a.batch);  // the first matrix product: the build reads its tiled threshold now
        a.seq_rm(a.mem, 0, 0, -1);
    }
    std::vector<int> context(depth > 0 ? depth : 1);
    for (size_t i = 0; i < context.size(); i++) context[i] = 100 + (int) (i * 7919 % 5000);
    std::vector<int> probe(64);
    for (size_t i = 0; i < probe.size(); i++) probe[i] = 200 + (int) (i * 104729 % 5000);
    for (Api & a : apis) {  // the context, and one untimed call of every size
        for (size_t at = 0; at < context.size(); at += 512) {  // the batch holds 512 tokens
            size_t end = std::min(context.size(), at + 512);
            fill(a, std::vector<int>(context.begin() + at, context.begin() + end), (int) at, false);
            if (a.decode(a.ctx, a.batch) != 0) { fprintf(stderr, "the context did not decode (depth %d)\n", depth); return 1; }
        }
        for (int n : rows) {
            fill(a, std::vector<int>(probe.begin(), probe.begin() + n), (int) context.size(), true);
            a.decode(a.ctx, a.batch); a.synchronize(a.ctx);
            a.seq_rm(a.mem, 0, (int) context.size(), -1);
        }
    }
    // t[row][build][round]
    std::vector<std::vector<std::vector<double>>> t(rows.size(), std::vector<std::vector<double>>(apis.size()));
    for (int r = 0; r < rounds; r++) {
        for (size_t ri = 0; ri < rows.size(); ri++) {
            int n = rows[ri];
            for (size_t k = 0; k < apis.size(); k++) {
                size_t b = (r % 2 == 0) ? k : apis.size() - 1 - k;
                Api & a = apis[b];
                std::vector<int> toks(probe.begin(), probe.begin() + n);
                double best = 1e30;
                for (int rep = 0; rep < 3; rep++) {
                    fill(a, toks, (int) context.size(), true);
                    double t0 = now_ms();
                    a.decode(a.ctx, a.batch);
                    a.synchronize(a.ctx);
                    double dt = now_ms() - t0;
                    a.seq_rm(a.mem, 0, (int) context.size(), -1);
                    best = std::min(best, dt);
                }
                t[ri][b].push_back(best);
            }
        }
    }
    auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    printf("| rows |");
    for (auto & d : dirs) printf(" %s: ms | x first |", d.c_str());
    printf("\n|---|");
    for (size_t b = 0; b < dirs.size(); b++) printf("---|---|");
    printf("\n");
    for (size_t ri = 0; ri < rows.size(); ri++) {
        printf("| %d |", rows[ri]);
        for (size_t b = 0; b < apis.size(); b++) {
            std::vector<double> ratio;
            for (int r = 0; r < rounds; r++) ratio.push_back(t[ri][b][r] / t[ri][0][r]);
            printf(" %.*f | %.3f |", median(t[ri][b]) < 1 ? 3 : 1, median(t[ri][b]), median(ratio));
        }
        printf("\n");
    }
    return 0;
}
