/* Reads launch_counts.txt: the expected launches of one op call, per case.
 * Each non-comment line is an op name and then key=value fields, a value
 * being a comma-separated list of integers (shapes) or one integer:
 *
 *   linear in=8,8,12 out=12,16,16 ranks=1,8,30,30,30,16,1 features=768,3072
 *          batch=2 bias=1 dx=1 fwd=4,2,1 bwd=11,4,0
 *
 * fwd and bwd are (kernels, cuBLAS calls, copies) of one forward and one
 * backward call.  The same file is read by comera's Python tests of the GPU
 * cost model (tests/ops/test_gpu_cost.py), so the model's launch counts and
 * the emulation's are checked against one table. */
#ifndef COMERA_EMU_LAUNCH_TABLE_H
#define COMERA_EMU_LAUNCH_TABLE_H

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

struct LaunchCase {
    std::string op, line;
    std::map<std::string, std::vector<int64_t>> f;
    const std::vector<int64_t> &at(const std::string &key) const {
        static const std::vector<int64_t> none;
        auto it = f.find(key);
        return it == f.end() ? none : it->second;
    }
    int64_t one(const std::string &key) const {
        const std::vector<int64_t> &v = at(key);
        return v.empty() ? -1 : v[0];
    }
};

/* The cases of `op` in the table at `path` (empty if it cannot be read). */
static inline std::vector<LaunchCase> read_launch_table(const char *path, const std::string &op) {
    std::vector<LaunchCase> out;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        size_t hash = line.find('#');
        std::string body = hash == std::string::npos ? line : line.substr(0, hash);
        std::istringstream words(body);
        LaunchCase c;
        if (!(words >> c.op) || c.op != op) continue;
        c.line = body;
        std::string w;
        while (words >> w) {
            size_t eq = w.find('=');
            if (eq == std::string::npos) continue;
            std::vector<int64_t> v;
            std::istringstream items(w.substr(eq + 1));
            std::string item;
            while (std::getline(items, item, ',')) v.push_back(std::strtoll(item.c_str(), nullptr, 10));
            c.f[w.substr(0, eq)] = v;
        }
        out.push_back(c);
    }
    return out;
}

#endif
