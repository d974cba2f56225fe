// tokenloom native helpers (pybind11 module tokenloom._native).
// Each function here has a numpy reference with the same signature in
// tokenloom/blending/reference.py; tests compare the two on random inputs.
//
// The functions reproduce the results of Megatron-LM's dataset helpers
// (megatron/core/datasets/helpers.cpp, see docs/megatron-data-spec.md E.1),
// quirks included, but differ in how they treat bad input:
//   * arrays are never converted: a wrong dtype, a non-contiguous or a
//     read-only output array raises TypeError / ValueError (Megatron silently
//     fills a converted temporary);
//   * indices are bounds-checked and raise ValueError (Megatron: undefined
//     behaviour);
//   * per-dataset scratch arrays live on the heap, and the GIL is released
//     while the loops run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kMaxDatasets = std::numeric_limits<int16_t>::max();  // dataset_index is int16

template <typename T>
const char *dtype_name();
template <>
const char *dtype_name<int16_t>() { return "int16"; }
template <>
const char *dtype_name<int32_t>() { return "int32"; }
template <>
const char *dtype_name<int64_t>() { return "int64"; }
template <>
const char *dtype_name<double>() { return "float64"; }
template <>
const char *dtype_name<uint32_t>() { return "uint32"; }
template <>
const char *dtype_name<uint64_t>() { return "uint64"; }
template <>
const char *dtype_name<uint8_t>() { return "uint8"; }

// Check that `obj` is a 1-D C-contiguous numpy array of exactly dtype T (no casts).
template <typename T>
py::array_t<T, py::array::c_style> checked_array(py::handle obj, const char *name, bool writable) {
    if (!py::isinstance<py::array>(obj)) {
        throw py::type_error(std::string("argument '") + name + "' must be a numpy array of dtype " +
                             dtype_name<T>() + ", got " + std::string(py::str(py::type::of(obj))));
    }
    auto arr = py::reinterpret_borrow<py::array>(obj);
    if (!arr.dtype().equal(py::dtype::of<T>())) {
        throw py::type_error(std::string("argument '") + name + "' must have dtype " + dtype_name<T>() +
                             " (native byte order), got " + std::string(py::str(arr.dtype())));
    }
    if (arr.ndim() != 1) {
        throw py::value_error(std::string("argument '") + name + "' must be 1-D, got " +
                              std::to_string(arr.ndim()) + " dimensions");
    }
    if (!(arr.flags() & py::array::c_style)) {
        throw py::value_error(std::string("argument '") + name + "' must be C-contiguous");
    }
    if (writable && !arr.writeable()) {
        throw py::value_error(std::string("argument '") + name + "' must be writable");
    }
    return py::reinterpret_borrow<py::array_t<T, py::array::c_style>>(obj);
}

// Number of samples the sample index will hold (Megatron's formula, E.3 quirk included).
int64_t count_samples(int64_t total_tokens, int32_t seq_length, bool drop_last, bool exact_ceil) {
    if (drop_last) {
        return total_tokens / seq_length;  // C division: truncates toward zero
    }
    if (exact_ceil) {
        int64_t q = total_tokens / seq_length;
        return (total_tokens % seq_length > 0) ? q + 1 : q;
    }
    // Megatron divides in single precision: exact only below 2^24 tokens.
    float ratio = static_cast<float>(total_tokens) / static_cast<float>(seq_length);
    return static_cast<int64_t>(std::ceil(ratio));
}

// Fill rows 1..num_samples of `out` ([num_samples + 1, 2], row 0 already set).
// Returns an error message, empty on success. Runs without the GIL.
template <typename T>
std::string fill_sample_idx(const int32_t *sizes, int64_t num_sizes, const int32_t *doc_idx, int64_t num_docs,
                            int32_t seq_length, int32_t add_extra_token, int64_t num_samples, T *out) {
    if (num_samples == 0) return {};
    // Validate once and gather each position's length: the walk below then reads lengths
    // sequentially instead of chasing sizes[doc_idx[i]] at random (a cache miss each on
    // large datasets). Prefetching the gather hides most of its misses.
    constexpr int64_t kAhead = 32;
    std::vector<int32_t> doc_sizes(static_cast<size_t>(num_docs));
    for (int64_t pos = 0; pos < num_docs; ++pos) {
        if (pos + kAhead < num_docs) __builtin_prefetch(sizes + doc_idx[pos + kAhead]);  // never faults
        const int32_t seq = doc_idx[pos];
        if (seq < 0 || seq >= num_sizes) {
            return "doc_idx[" + std::to_string(pos) + "] = " + std::to_string(seq) +
                   " is out of range for sizes of length " + std::to_string(num_sizes);
        }
        if (sizes[seq] < 0) return "sizes[" + std::to_string(seq) + "] = " + std::to_string(sizes[seq]) + " is negative";
        doc_sizes[static_cast<size_t>(pos)] = sizes[seq];
    }
    int64_t position = 0;  // index into doc_idx
    int64_t offset = 0;    // token offset inside sequence doc_idx[position]
    for (int64_t sample = 1; sample <= num_samples; ++sample) {
        int64_t remaining = static_cast<int64_t>(seq_length) + add_extra_token;
        while (remaining != 0) {
            const int64_t length = doc_sizes[static_cast<size_t>(position)];
            const int64_t available = length - offset;
            remaining -= available;
            if (remaining <= 0) {
                // The sample ends inside this sequence; the next one starts
                // add_extra_token tokens before that end.
                offset += remaining + available - add_extra_token;
                remaining = 0;
            } else if (position == num_docs - 1) {
                // Out of sequences: only the final partial sample gets here.
                offset = length - add_extra_token;
                break;
            } else {
                ++position;
                offset = 0;
            }
        }
        out[2 * sample] = static_cast<T>(position);
        out[2 * sample + 1] = static_cast<T>(offset);
    }
    return {};
}

template <typename T>
py::array_t<T> build_sample_idx(py::handle sizes_obj, py::handle doc_idx_obj, int32_t seq_length, int32_t num_epochs,
                                int64_t tokens_per_epoch, bool drop_last, int add_extra_token, bool exact_ceil) {
    auto sizes = checked_array<int32_t>(sizes_obj, "sizes", false);
    auto doc_idx = checked_array<int32_t>(doc_idx_obj, "doc_idx", false);
    if (seq_length < 1) throw py::value_error("seq_length must be >= 1, got " + std::to_string(seq_length));
    if (num_epochs < 1) throw py::value_error("num_epochs must be >= 1, got " + std::to_string(num_epochs));
    if (tokens_per_epoch < 0) {
        throw py::value_error("tokens_per_epoch must be >= 0, got " + std::to_string(tokens_per_epoch));
    }
    if (add_extra_token != 0 && add_extra_token != 1) {
        throw py::value_error("add_extra_token must be 0 or 1, got " + std::to_string(add_extra_token));
    }
    const int64_t num_docs = doc_idx.shape(0);
    if (num_docs - 1 > static_cast<int64_t>(std::numeric_limits<T>::max())) {
        throw py::value_error("doc_idx has " + std::to_string(num_docs) + " entries, too many for a " +
                              dtype_name<T>() + " sample index; use build_sample_idx_int64");
    }
    if (tokens_per_epoch > std::numeric_limits<int64_t>::max() / num_epochs) {
        throw py::value_error("num_epochs * tokens_per_epoch overflows int64");
    }
    const int64_t total_tokens = static_cast<int64_t>(num_epochs) * tokens_per_epoch - add_extra_token;
    const int64_t num_samples = count_samples(total_tokens, seq_length, drop_last, exact_ceil);
    if (num_samples < 0) {
        throw py::value_error("num_epochs * tokens_per_epoch - add_extra_token is negative (" +
                              std::to_string(total_tokens) + ")");
    }
    if (num_samples > 0 && num_docs == 0) {
        throw py::value_error("doc_idx is empty but " + std::to_string(num_samples) + " samples are requested");
    }

    py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
    T *out = result.mutable_data();
    out[0] = 0;
    out[1] = 0;
    std::string error;
    {
        py::gil_scoped_release release;
        error = fill_sample_idx<T>(sizes.data(), sizes.shape(0), doc_idx.data(), num_docs, seq_length,
                                  add_extra_token, num_samples, out);
    }
    if (!error.empty()) throw py::value_error(error);
    return result;
}

void check_num_datasets(int32_t num_datasets, bool allow_zero) {
    if (num_datasets < (allow_zero ? 0 : 1)) {
        throw py::value_error("num_datasets must be >= " + std::to_string(allow_zero ? 0 : 1) + ", got " +
                              std::to_string(num_datasets));
    }
    if (num_datasets > kMaxDatasets) {
        throw py::value_error("at most " + std::to_string(kMaxDatasets) +
                              " datasets can be blended (the dataset index is int16), got " +
                              std::to_string(num_datasets));
    }
}

void check_length(int64_t have, int64_t need, const char *name) {
    if (have < need) {
        throw py::value_error(std::string("argument '") + name + "' has " + std::to_string(have) +
                              " elements, needs at least " + std::to_string(need));
    }
}

// The greedy rule of Megatron's build_blending_indices: sample i goes to the dataset whose
// count lags its target w[d] * max(i, 1) most, the lowest index on ties. Counts are held as
// doubles (exact below 2^53) so the error needs no conversion. The loop carries a dependency
// through the counts, so its speed is their latency: with D fixed at compile time they stay
// in registers and the selection compiles to conditional moves (about 4x the generic loop).
template <int D>
void greedy_blend(const double *w_in, double *counts, int64_t size, int16_t *index_out, int64_t *sample_out) {
    double w[D], c[D];
    for (int d = 0; d < D; ++d) {
        w[d] = w_in[d];
        c[d] = counts[d];
    }
    for (int64_t i = 0; i < size; ++i) {
        // Megatron's target is w * max(i, 1), not w * (i + 1): keep it.
        const double t = std::max(static_cast<double>(i), 1.0);
        int32_t best = 0;
        double best_error = w[0] * t - c[0];
#pragma GCC unroll 8
        for (int32_t d = 1; d < D; ++d) {
            const double error = w[d] * t - c[d];
            const bool greater = error > best_error;
            best_error = greater ? error : best_error;
            best = greater ? d : best;
        }
        double drawn = 0.0;
#pragma GCC unroll 8
        for (int32_t d = 0; d < D; ++d) {
            drawn = d == best ? c[d] : drawn;
            c[d] += d == best ? 1.0 : 0.0;
        }
        index_out[i] = static_cast<int16_t>(best);
        sample_out[i] = static_cast<int64_t>(drawn);
    }
    for (int d = 0; d < D; ++d) counts[d] = c[d];
}

void greedy_blend_any(const double *w, double *c, int32_t num_datasets, int64_t size, int16_t *index_out,
                      int64_t *sample_out) {
    for (int64_t i = 0; i < size; ++i) {
        const double t = std::max(static_cast<double>(i), 1.0);
        int32_t best = 0;
        double best_error = w[0] * t - c[0];
        for (int32_t d = 1; d < num_datasets; ++d) {
            const double error = w[d] * t - c[d];
            if (error > best_error) {
                best_error = error;
                best = d;
            }
        }
        index_out[i] = static_cast<int16_t>(best);
        sample_out[i] = static_cast<int64_t>(c[best]);
        c[best] += 1.0;
    }
}

void build_blending_indices(py::handle dataset_index_obj, py::handle dataset_sample_index_obj,
                            py::handle weights_obj, int32_t num_datasets, int64_t size, bool verbose) {
    auto dataset_index = checked_array<int16_t>(dataset_index_obj, "dataset_index", true);
    auto dataset_sample_index = checked_array<int64_t>(dataset_sample_index_obj, "dataset_sample_index", true);
    auto weights_arr = checked_array<double>(weights_obj, "weights", false);
    check_num_datasets(num_datasets, false);
    if (size < 0) throw py::value_error("size must be >= 0, got " + std::to_string(size));
    check_length(weights_arr.shape(0), num_datasets, "weights");
    check_length(dataset_index.shape(0), size, "dataset_index");
    check_length(dataset_sample_index.shape(0), size, "dataset_sample_index");

    if (verbose) py::print("> building indices for blended datasets ...");
    std::vector<double> weights(weights_arr.data(), weights_arr.data() + num_datasets);
    std::vector<double> counts(num_datasets, 0.0);
    int16_t *index_out = dataset_index.mutable_data();
    int64_t *sample_out = dataset_sample_index.mutable_data();
    {
        py::gil_scoped_release release;
        switch (num_datasets) {  // the common few-source blends keep their counts in registers
            case 1: greedy_blend<1>(weights.data(), counts.data(), size, index_out, sample_out); break;
            case 2: greedy_blend<2>(weights.data(), counts.data(), size, index_out, sample_out); break;
            case 3: greedy_blend<3>(weights.data(), counts.data(), size, index_out, sample_out); break;
            case 4: greedy_blend<4>(weights.data(), counts.data(), size, index_out, sample_out); break;
            case 5: greedy_blend<5>(weights.data(), counts.data(), size, index_out, sample_out); break;
            case 6: greedy_blend<6>(weights.data(), counts.data(), size, index_out, sample_out); break;
            case 7: greedy_blend<7>(weights.data(), counts.data(), size, index_out, sample_out); break;
            case 8: greedy_blend<8>(weights.data(), counts.data(), size, index_out, sample_out); break;
            default: greedy_blend_any(weights.data(), counts.data(), num_datasets, size, index_out, sample_out);
        }
    }
    if (verbose) {
        py::print(" > sample ratios:");
        for (int32_t d = 0; d < num_datasets; ++d) {
            std::ostringstream line;
            line << "   dataset " << d << ", input: " << weights[d]
                 << ", achieved: " << static_cast<double>(counts[d]) / static_cast<double>(size);
            py::print(line.str());
        }
    }
}

void build_exhaustive_blending_indices(py::handle dataset_index_obj, py::handle dataset_sample_index_obj,
                                       py::handle sizes_obj, int32_t num_datasets) {
    auto dataset_index = checked_array<int16_t>(dataset_index_obj, "dataset_index", true);
    auto dataset_sample_index = checked_array<int64_t>(dataset_sample_index_obj, "dataset_sample_index", true);
    auto sizes_arr = checked_array<int64_t>(sizes_obj, "sizes", false);
    check_num_datasets(num_datasets, true);
    check_length(sizes_arr.shape(0), num_datasets, "sizes");

    std::vector<int64_t> sizes(sizes_arr.data(), sizes_arr.data() + num_datasets);
    int64_t total = 0;
    for (int32_t d = 0; d < num_datasets; ++d) {
        // A dataset of size <= 0 would never be exhausted (Megatron loops forever).
        if (sizes[d] < 1) {
            throw py::value_error("sizes[" + std::to_string(d) + "] must be >= 1, got " + std::to_string(sizes[d]));
        }
        if (sizes[d] > std::numeric_limits<int64_t>::max() - total) throw py::value_error("sum of sizes overflows");
        total += sizes[d];
    }
    check_length(dataset_index.shape(0), total, "dataset_index");
    check_length(dataset_sample_index.shape(0), total, "dataset_sample_index");

    std::vector<double> weights(num_datasets);
    for (int32_t d = 0; d < num_datasets; ++d) weights[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
    std::vector<int64_t> counts(num_datasets, 0);
    std::vector<int32_t> live(num_datasets);  // datasets with samples left, increasing order
    for (int32_t d = 0; d < num_datasets; ++d) live[d] = d;
    int16_t *index_out = dataset_index.mutable_data();
    int64_t *sample_out = dataset_sample_index.mutable_data();
    {
        py::gil_scoped_release release;
        for (int64_t i = 0; !live.empty(); ++i) {
            const double t = std::max(static_cast<double>(i), 1.0);
            size_t best_pos = 0;
            double best_error = std::numeric_limits<double>::lowest();
            for (size_t k = 0; k < live.size(); ++k) {
                const int32_t d = live[k];
                const double error = weights[d] * t - static_cast<double>(counts[d]);
                if (error > best_error) {
                    best_error = error;
                    best_pos = k;
                }
            }
            const int32_t best = live[best_pos];
            index_out[i] = static_cast<int16_t>(best);
            sample_out[i] = counts[best]++;
            if (counts[best] == sizes[best]) live.erase(live.begin() + static_cast<std::ptrdiff_t>(best_pos));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// numpy's legacy RandomState.shuffle, bit for bit, without the GIL.
//
// Megatron shuffles its document and shuffle indices with numpy.random.RandomState (MT19937).
// numpy's shuffle of a 1-D array is Fisher-Yates: for i = n-1 .. 1, j = random_interval(i),
// swap a[i], a[j]; random_interval(max) draws masked 32-bit words (64-bit above 2^32) until
// one is <= max. Here the generator state (the 624-word key and position, as returned by
// RandomState.get_state()) comes in and goes out, so the caller can set it back and numpy's
// stream continues exactly as if numpy had shuffled.

struct MT19937 {
    static constexpr int N = 624, M = 397;
    uint32_t *key;
    int pos;
    uint32_t out[N];  // out[k] = tempered key[k], valid for k >= pos

    MT19937(uint32_t *key_words, int position) : key(key_words), pos(position) { temper(position); }

    void temper(int from) {  // a whole block at once: the compiler vectorises this loop
        for (int k = from; k < N; ++k) {
            uint32_t y = key[k];
            y ^= (y >> 11);
            y ^= (y << 7) & 0x9d2c5680U;
            y ^= (y << 15) & 0xefc60000U;
            y ^= (y >> 18);
            out[k] = y;
        }
    }

    void refill() {
        constexpr uint32_t kMatrixA = 0x9908b0dfU, kUpper = 0x80000000U, kLower = 0x7fffffffU;
        uint32_t y;
        for (int kk = 0; kk < N - M; ++kk) {
            y = (key[kk] & kUpper) | (key[kk + 1] & kLower);
            key[kk] = key[kk + M] ^ (y >> 1) ^ (-(y & 1U) & kMatrixA);
        }
        for (int kk = N - M; kk < N - 1; ++kk) {
            y = (key[kk] & kUpper) | (key[kk + 1] & kLower);
            key[kk] = key[kk + (M - N)] ^ (y >> 1) ^ (-(y & 1U) & kMatrixA);
        }
        y = (key[N - 1] & kUpper) | (key[0] & kLower);
        key[N - 1] = key[M - 1] ^ (y >> 1) ^ (-(y & 1U) & kMatrixA);
        pos = 0;
        temper(0);
    }

    // js[k] = random_interval(top - k) for k < count, all top - k >= 1 (numpy's legacy masked
    // rejection: draw 32-bit words, keep word & mask, retry while it exceeds max). Branch-free:
    // every draw is written and the slot advances only on acceptance, so the ~30% rejections
    // cost no mispredicted branches.
    void intervals(int64_t top, int64_t count, int64_t *js) {
        int64_t k = 0;
        while (k < count) {
            if (pos == N) refill();
            const uint32_t max = static_cast<uint32_t>(top - k);
            const uint32_t value = out[pos++] & (0xffffffffU >> __builtin_clz(max));
            js[k] = value;
            k += value <= max;
        }
    }
};

template <typename T>
int legacy_shuffle(py::handle array_obj, py::handle key_obj, int pos) {
    auto array = checked_array<T>(array_obj, "array", true);
    auto key = checked_array<uint32_t>(key_obj, "key", true);
    if (key.shape(0) != MT19937::N) {
        throw py::value_error("argument 'key' must hold the 624 words of an MT19937 state");
    }
    if (pos < 0 || pos > MT19937::N) {
        throw py::value_error("argument 'pos' must lie in [0, 624]");
    }
    const int64_t n = array.shape(0);
    if (n - 1 > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
        throw py::value_error("legacy_shuffle handles arrays up to 2^32 elements; use numpy beyond");
    }
    T *data = array.mutable_data();
    MT19937 mt(key.mutable_data(), pos);
    {
        py::gil_scoped_release release;
        // The draws do not depend on the data, so draw a block of j ahead and prefetch a[j]:
        // random swaps on a large array are bound by cache misses, not by the generator.
        constexpr int64_t kBlock = 256, kAhead = 16;
        int64_t js[kBlock];
        for (int64_t top = n - 1; top >= 1; top -= kBlock) {
            const int64_t count = std::min(kBlock, top);  // i = top, top-1, ..., top-count+1 (>= 1)
            mt.intervals(top, count, js);
            for (int64_t k = 0; k < count; ++k) {
                if (k + kAhead < count) __builtin_prefetch(data + js[k + kAhead], 1);
                std::swap(data[top - k], data[js[k]]);
            }
        }
    }
    return mt.pos;
}

const char *kShuffleDoc = R"doc(Shuffle a 1-D array in place exactly as numpy.random.RandomState.shuffle would.

key (uint32[624], updated in place) and pos are the MT19937 state from RandomState.get_state();
returns the new pos. Set the state back with RandomState.set_state to continue the stream.)doc";

const char *kSampleIdxDoc = R"doc(Build the GPT sample index: a [n + 1, 2] array of (position in doc_idx, token offset).

Same results as Megatron's build_sample_idx_<T>. With drop_last false, n is computed
in single precision like Megatron unless exact_ceil is true.)doc";


// ---------------------------------------------------------------------------- best-fit packing
//
// One epoch of documents (doc_idx, in the epoch's shuffled order) packed into samples of
// `capacity` tokens. A document longer than `capacity` is cut into pieces that start every
// `step` tokens (capacity - step tokens shared, so no label is lost) and are `capacity` long
// but the last. Every piece of `capacity` tokens is a sample of its own; the rest (whole short
// documents, last pieces) are placed by best-fit decreasing: longest first (ties in doc_idx
// order: a stable counting sort), each into the open sample with the least room that holds it,
// else into a new one. The open samples are kept by room in stacks (latest first), and a
// segment tree over room values finds the least room >= a length in O(log capacity).
// Then the refill (below) may empty a few samples that hold only last pieces into the others.
// Output: parts int32 [P, 3] (document, offset, length) grouped by sample, in doc_idx order
// within a sample (then the refill's parts, in pouring order), and sample_index int64 [S + 1],
// where sample s's parts are rows sample_index[s] .. sample_index[s + 1]. The best-fit samples
// come first (in the order they were opened), then the full pieces in doc_idx order. Runs
// without the GIL.

struct RoomTree {  // which room values 1..capacity-1 have an open sample
    int64_t size = 1;
    std::vector<uint8_t> set;
    explicit RoomTree(int64_t leaves) {
        while (size < leaves) size <<= 1;
        set.assign(static_cast<size_t>(2 * size), 0);
    }
    void mark(int64_t leaf, bool on) {
        int64_t i = leaf + size;
        set[static_cast<size_t>(i)] = on;
        for (i >>= 1; i >= 1; i >>= 1) {
            const uint8_t v = set[static_cast<size_t>(2 * i)] | set[static_cast<size_t>(2 * i + 1)];
            if (set[static_cast<size_t>(i)] == v) break;
            set[static_cast<size_t>(i)] = v;
        }
    }
    int64_t first_at_least(int64_t leaf) const {  // smallest marked leaf >= leaf, or -1
        int64_t i = leaf + size;
        if (set[static_cast<size_t>(i)]) return leaf;
        while (i > 1) {
            if ((i & 1) == 0 && set[static_cast<size_t>(i + 1)]) {
                ++i;
                break;
            }
            i >>= 1;
        }
        if (i == 1) return -1;
        while (i < size) i = set[static_cast<size_t>(2 * i)] ? 2 * i : 2 * i + 1;
        return i - size;
    }
};

// The length of the piece of a `length`-token document left for best fit (0: none), and how
// many full (`capacity`-token) pieces precede it.
inline void split_document(int64_t length, int64_t capacity, int64_t step, int64_t *full, int64_t *last) {
    *full = 0;
    *last = length;
    if (length > capacity) {
        const int64_t pieces = (length - (capacity - step) + step - 1) / step;
        *last = length - (pieces - 1) * step;
        *full = pieces - 1;
    }
    if (*last == capacity) {
        ++*full;
        *last = 0;
    }
}

// The refill. The last piece of a cut document is a fragment already (its start lies in the
// piece before), so it may be cut again at no cost to a whole document. Where best fit leaves
// `capacity` or more tokens of room in all, up to room / capacity of the samples that hold only
// last pieces (emptiest first, ties in opening order) are emptied into the rooms of the others
// (largest room first, ties in opening order; a room of `overlap` tokens or less holds nothing):
// each piece is poured room after room, its parts sharing `overlap` tokens as pieces do. The
// count emptied is the largest that fits (binary search). Whole documents never move.
struct Poured {
    int32_t bin, position, offset, length;
};

struct Refill {
    const std::vector<int32_t> &room;  // per best-fit sample
    const std::vector<int32_t> &bin_of, &tail;
    const int32_t *sz, *docs;
    int64_t overlap;
    std::vector<int32_t> candidates, rank_of, piece_start, pieces, rooms;

    // Samples to empty, in order (at most kmax), their pieces (positions) grouped by rank, and
    // the rooms that may take them, largest first.
    void prepare(const std::vector<uint8_t> &whole, int64_t capacity) {
        const int64_t bins = static_cast<int64_t>(room.size());
        int64_t total = 0;
        for (int64_t b = 0; b < bins; ++b) {
            total += room[static_cast<size_t>(b)];
            if (!whole[static_cast<size_t>(b)] && room[static_cast<size_t>(b)] > 0) candidates.push_back(static_cast<int32_t>(b));
        }
        auto roomier = [this](int32_t a, int32_t b) { return room[static_cast<size_t>(a)] > room[static_cast<size_t>(b)]; };
        std::stable_sort(candidates.begin(), candidates.end(), roomier);
        candidates.resize(static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(candidates.size()), total / capacity)));
        const int64_t kmax = static_cast<int64_t>(candidates.size());
        if (kmax == 0) return;
        rank_of.assign(static_cast<size_t>(bins), std::numeric_limits<int32_t>::max());
        for (int64_t r = 0; r < kmax; ++r) rank_of[static_cast<size_t>(candidates[static_cast<size_t>(r)])] = static_cast<int32_t>(r);
        piece_start.assign(static_cast<size_t>(kmax) + 1, 0);
        const int64_t n = static_cast<int64_t>(bin_of.size());
        for (int64_t p = 0; p < n; ++p) {
            const int32_t b = bin_of[static_cast<size_t>(p)];
            if (b >= 0 && rank_of[static_cast<size_t>(b)] < kmax) ++piece_start[static_cast<size_t>(rank_of[static_cast<size_t>(b)]) + 1];
        }
        for (int64_t r = 0; r < kmax; ++r) piece_start[static_cast<size_t>(r) + 1] += piece_start[static_cast<size_t>(r)];
        pieces.resize(static_cast<size_t>(piece_start[static_cast<size_t>(kmax)]));
        std::vector<int32_t> cursor(piece_start.begin(), piece_start.end() - 1);
        for (int64_t p = 0; p < n; ++p) {
            const int32_t b = bin_of[static_cast<size_t>(p)];
            if (b >= 0 && rank_of[static_cast<size_t>(b)] < kmax) pieces[static_cast<size_t>(cursor[static_cast<size_t>(rank_of[static_cast<size_t>(b)])]++)] = static_cast<int32_t>(p);
        }
        for (int64_t b = 0; b < bins; ++b) {
            if (room[static_cast<size_t>(b)] > overlap) rooms.push_back(static_cast<int32_t>(b));
        }
        std::stable_sort(rooms.begin(), rooms.end(), roomier);
    }

    // Whether the first k candidates' pieces fit the other samples' rooms; the parts into out.
    bool pour(int64_t k, std::vector<Poured> *out) const {
        size_t g = 0;
        int64_t left = 0;
        auto next_room = [&]() {
            for (; g < rooms.size(); ++g) {
                if (rank_of[static_cast<size_t>(rooms[g])] >= k) {
                    left = room[static_cast<size_t>(rooms[g])];
                    return true;
                }
            }
            return false;
        };
        if (!next_room()) return k == 0;
        for (int32_t i = 0; i < piece_start[static_cast<size_t>(k)]; ++i) {
            const int32_t p = pieces[static_cast<size_t>(i)];
            int64_t rest = tail[static_cast<size_t>(p)], at = sz[docs[p]] - rest;
            while (true) {
                if (left <= overlap) {
                    ++g;
                    if (!next_room()) return false;
                }
                const int64_t take = std::min(rest, left);
                if (out) out->push_back({rooms[g], p, static_cast<int32_t>(at), static_cast<int32_t>(take)});
                left -= take;
                if (take == rest) break;
                at += take - overlap;
                rest -= take - overlap;
                left = 0;
            }
        }
        return true;
    }
};

py::tuple pack_best_fit(py::handle sizes_obj, py::handle doc_idx_obj, int32_t capacity, int32_t step) {
    auto sizes = checked_array<int32_t>(sizes_obj, "sizes", false);
    auto doc_idx = checked_array<int32_t>(doc_idx_obj, "doc_idx", false);
    if (capacity < 2) throw py::value_error("capacity must be >= 2, got " + std::to_string(capacity));
    if (step < 1 || step > capacity) {
        throw py::value_error("step must lie in [1, capacity], got " + std::to_string(step));
    }
    const int64_t n = doc_idx.shape(0), num_sizes = sizes.shape(0);
    if (n > std::numeric_limits<int32_t>::max()) throw py::value_error("doc_idx has more than 2^31 - 1 entries");
    const int32_t *sz = sizes.data(), *docs = doc_idx.data();
    std::string error;
    // Scratch is kept to 4 bytes per document beside the output (bin_of) while the output is
    // written; the sort's arrays are freed before it is allocated.
    std::vector<int32_t> bin_of;  // sample of each position's best-fit piece (-1: none)
    std::vector<int64_t> bin_count;
    std::vector<Poured> poured;  // the refill's parts
    int64_t bins = 0, num_full = 0, items = 0, kept = 0;
    {
        py::gil_scoped_release release;
        std::vector<int32_t> tail(static_cast<size_t>(n));
        for (int64_t p = 0; p < n; ++p) {
            const int32_t d = docs[p];
            if (d < 0 || d >= num_sizes) {
                error = "doc_idx[" + std::to_string(p) + "] = " + std::to_string(d) +
                        " is out of range for sizes of length " + std::to_string(num_sizes);
                break;
            }
            if (sz[d] < 0) {
                error = "sizes[" + std::to_string(d) + "] = " + std::to_string(sz[d]) + " is negative";
                break;
            }
            int64_t full, last;
            split_document(sz[d], capacity, step, &full, &last);
            tail[static_cast<size_t>(p)] = static_cast<int32_t>(last);
            num_full += full;
            items += last > 0;
        }
        if (error.empty()) {
            // stable counting sort of the tails, longest first
            std::vector<int32_t> order(static_cast<size_t>(items));
            {
                std::vector<int64_t> start(static_cast<size_t>(capacity) + 1, 0);
                for (int64_t p = 0; p < n; ++p) {
                    const int32_t t = tail[static_cast<size_t>(p)];
                    if (t > 0) ++start[static_cast<size_t>(capacity - t)];
                }
                int64_t acc = 0;
                for (auto &v : start) {
                    const int64_t c = v;
                    v = acc;
                    acc += c;
                }
                for (int64_t p = 0; p < n; ++p) {
                    const int32_t t = tail[static_cast<size_t>(p)];
                    if (t > 0) order[static_cast<size_t>(start[static_cast<size_t>(capacity - t)]++)] = static_cast<int32_t>(p);
                }
            }
            bin_of.assign(static_cast<size_t>(n), -1);
            std::vector<int32_t> bin_room;  // room left in each best-fit sample
            std::vector<uint8_t> whole;     // whether it holds a whole document
            RoomTree tree(capacity);
            std::vector<std::vector<int32_t>> open(static_cast<size_t>(capacity));  // room -> samples
            for (int64_t k = 0; k < items; ++k) {
                const int64_t p = order[static_cast<size_t>(k)];
                const int64_t t = tail[static_cast<size_t>(p)];
                const int64_t room = tree.first_at_least(t);
                int64_t bin, left;
                if (room < 0) {
                    bin = bins++;
                    bin_count.push_back(0);
                    bin_room.push_back(0);
                    whole.push_back(0);
                    left = capacity - t;
                } else {
                    auto &stack = open[static_cast<size_t>(room)];
                    bin = stack.back();
                    stack.pop_back();
                    if (stack.empty()) tree.mark(room, false);
                    left = room - t;
                }
                if (left > 0) {
                    auto &stack = open[static_cast<size_t>(left)];
                    if (stack.empty()) tree.mark(left, true);
                    stack.push_back(static_cast<int32_t>(bin));
                }
                bin_of[static_cast<size_t>(p)] = static_cast<int32_t>(bin);
                ++bin_count[static_cast<size_t>(bin)];
                bin_room[static_cast<size_t>(bin)] = static_cast<int32_t>(left);
                whole[static_cast<size_t>(bin)] |= sz[docs[p]] <= capacity;
            }
            Refill refill{bin_room, bin_of, tail, sz, docs, capacity - step, {}, {}, {}, {}, {}};
            refill.prepare(whole, capacity);
            int64_t lo = 0, hi = static_cast<int64_t>(refill.candidates.size());
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (refill.pour(mid, nullptr)) lo = mid;
                else hi = mid - 1;
            }
            // best-fit sample -> output sample (-1: emptied by the refill)
            std::vector<int32_t> renumber(static_cast<size_t>(bins), 0);
            if (lo > 0) {
                refill.pour(lo, &poured);
                for (int64_t r = 0; r < lo; ++r) renumber[static_cast<size_t>(refill.candidates[static_cast<size_t>(r)])] = -1;
                for (int64_t i = 0; i < refill.piece_start[static_cast<size_t>(lo)]; ++i) {
                    bin_of[static_cast<size_t>(refill.pieces[static_cast<size_t>(i)])] = -1;
                }
                for (const Poured &part : poured) ++bin_count[static_cast<size_t>(part.bin)];
                items += static_cast<int64_t>(poured.size()) - refill.piece_start[static_cast<size_t>(lo)];
            }
            for (int64_t b = 0; b < bins; ++b) {
                if (renumber[static_cast<size_t>(b)] < 0) continue;
                bin_count[static_cast<size_t>(kept)] = bin_count[static_cast<size_t>(b)];
                renumber[static_cast<size_t>(b)] = static_cast<int32_t>(kept++);
            }
            bin_count.resize(static_cast<size_t>(kept));
            for (auto &b : bin_of) {
                if (b >= 0) b = renumber[static_cast<size_t>(b)];
            }
            for (auto &part : poured) part.bin = renumber[static_cast<size_t>(part.bin)];
        }
    }
    if (!error.empty()) throw py::value_error(error);
    const int64_t num_samples = kept + num_full;
    py::array_t<int32_t> parts({items + num_full, static_cast<int64_t>(3)});
    py::array_t<int64_t> sample_index(num_samples + 1);
    int32_t *out = parts.mutable_data();
    int64_t *si = sample_index.mutable_data();
    {
        py::gil_scoped_release release;
        si[0] = 0;
        for (int64_t b = 0; b < kept; ++b) si[b + 1] = si[b] + bin_count[static_cast<size_t>(b)];
        for (int64_t f = 0; f < num_full; ++f) si[kept + f + 1] = si[kept + f] + 1;
        // bin_count becomes each best-fit sample's write cursor
        for (int64_t b = 0; b < kept; ++b) bin_count[static_cast<size_t>(b)] = si[b];
        int32_t *full_row = out + 3 * si[kept];
        for (int64_t p = 0; p < n; ++p) {
            const int64_t length = sz[docs[p]];
            int64_t full, last;
            split_document(length, capacity, step, &full, &last);
            const int32_t bin = bin_of[static_cast<size_t>(p)];
            if (bin >= 0) {
                int32_t *row = out + 3 * bin_count[static_cast<size_t>(bin)]++;
                row[0] = docs[p];
                row[1] = static_cast<int32_t>(length - last);
                row[2] = static_cast<int32_t>(last);
            }
            for (int64_t f = 0; f < full; ++f, full_row += 3) {
                full_row[0] = docs[p];
                full_row[1] = static_cast<int32_t>(f * step);
                full_row[2] = capacity;
            }
        }
        for (const Poured &part : poured) {
            int32_t *row = out + 3 * bin_count[static_cast<size_t>(part.bin)]++;
            row[0] = docs[part.position];
            row[1] = part.offset;
            row[2] = part.length;
        }
    }
    return py::make_tuple(parts, sample_index);
}

const char *kPackDoc = R"doc(Pack one epoch of documents into samples of `capacity` tokens by best-fit decreasing.

doc_idx (int32) lists the epoch's documents in order (ties keep it); sizes (int32) their lengths.
A document longer than capacity is cut into pieces starting every `step` tokens; where the
samples' room adds up to whole samples, samples of last pieces only are poured into it. Returns
(parts int32 [P, 3] of (document, offset, length), sample_index int64 [S + 1]).)doc";

// ---------------------------------------------------------------- MinHash signatures (tokenloom.clean.keys)

// XXH64 (seed 0), written from the published xxHash specification (doc/xxhash_spec.md).
constexpr uint64_t kP1 = 11400714785074694791ULL, kP2 = 14029467366897019727ULL, kP3 = 1609587929392839161ULL,
                   kP4 = 9650029242287828579ULL, kP5 = 2870177450012600261ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;  // little-endian hosts only (checked by the caller's test against the xxhash package)
}
inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}
inline uint64_t round64(uint64_t acc, uint64_t lane) { return rotl(acc + lane * kP2, 31) * kP1; }
inline uint64_t merge64(uint64_t acc, uint64_t v) { return (acc ^ round64(0, v)) * kP1 + kP4; }

uint64_t xxh64(const uint8_t *p, size_t len) {
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = kP1 + kP2, v2 = kP2, v3 = 0, v4 = 0 - kP1;
        while (p + 32 <= end) {
            v1 = round64(v1, read64(p));
            v2 = round64(v2, read64(p + 8));
            v3 = round64(v3, read64(p + 16));
            v4 = round64(v4, read64(p + 24));
            p += 32;
        }
        h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
        h = merge64(h, v1);
        h = merge64(h, v2);
        h = merge64(h, v3);
        h = merge64(h, v4);
    } else {
        h = kP5;
    }
    h += static_cast<uint64_t>(len);
    while (p + 8 <= end) {
        h = rotl(h ^ round64(0, read64(p)), 27) * kP1 + kP4;
        p += 8;
    }
    if (p + 4 <= end) {
        h = rotl(h ^ (static_cast<uint64_t>(read32(p)) * kP1), 23) * kP2 + kP3;
        p += 4;
    }
    while (p < end) {
        h = rotl(h ^ (static_cast<uint64_t>(*p) * kP5), 11) * kP1;
        ++p;
    }
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
}

py::array_t<uint64_t> xxh64_array(py::handle data_obj, py::handle offsets_obj) {
    auto data = checked_array<uint8_t>(data_obj, "data", false);
    auto offsets = checked_array<int64_t>(offsets_obj, "offsets", false);
    const int64_t n = offsets.shape(0) - 1;
    py::array_t<uint64_t> out(std::max<int64_t>(n, 0));
    auto o = offsets.unchecked<1>();
    const uint8_t *d = data.data();
    uint64_t *r = out.mutable_data();
    for (int64_t i = 0; i < n; ++i) {
        if (o(i) < 0 || o(i + 1) < o(i) || o(i + 1) > data.shape(0)) throw py::value_error("offsets out of range");
        r[i] = xxh64(d + o(i), static_cast<size_t>(o(i + 1) - o(i)));
    }
    return out;
}

// The minimum of (a[k] * h + b[k]) mod (2^61 - 1) into row[k], for every k: products wrap at 64 bits (numpy's
// uint64), and x mod (2^61 - 1) = (x & p) + (x >> 61), less p once if still >= p (2^61 = 1 mod p). Cloned for
// AVX-512 (64-bit lane multiplies) and AVX2, picked at load time by the CPU; the same results on each.
__attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))
void permuted_minima(const uint64_t *a, const uint64_t *b, int64_t H, uint64_t h, uint64_t *row) {
    const uint64_t prime = (1ULL << 61) - 1;
    for (int64_t k = 0; k < H; ++k) {
        const uint64_t x = a[k] * h + b[k];
        uint64_t v = (x & prime) + (x >> 61);
        v = v >= prime ? v - prime : v;
        row[k] = v < row[k] ? v : row[k];
    }
}

inline bool ascii_space(uint8_t c) { return c == ' ' || (c >= 9 && c <= 13) || (c >= 28 && c <= 31); }
inline bool ascii_digit(uint8_t c) { return c >= '0' && c <= '9'; }
// What tokenloom.clean.normalize makes a separator in ASCII text: punctuation and symbols (every printable
// non-alphanumeric), control characters, whitespace.
inline bool ascii_separator(uint8_t c) {
    return c < 32 || c == 127 || (c < 128 && !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')));
}

// shingle_words of ASCII text, joined by single spaces, into out (cleared first): lowercase, each run of digits
// with at most one [.,]-separated decimal part made "0", every other non-alphanumeric a separator.
void simplify_ascii(const uint8_t *p, int64_t len, std::vector<uint8_t> &out) {
    out.clear();
    bool pending_space = false;
    int64_t i = 0;
    while (i < len) {
        uint8_t c = p[i];
        if (ascii_digit(c)) {
            while (i < len && ascii_digit(p[i])) ++i;
            if (i + 1 < len && (p[i] == '.' || p[i] == ',') && ascii_digit(p[i + 1])) {
                ++i;
                while (i < len && ascii_digit(p[i])) ++i;
            }
            if (pending_space && !out.empty()) out.push_back(' ');
            pending_space = false;
            out.push_back('0');
            continue;
        }
        if (ascii_separator(c)) {
            pending_space = true;
        } else {
            if (pending_space && !out.empty()) out.push_back(' ');
            pending_space = false;
            out.push_back(c >= 'A' && c <= 'Z' ? static_cast<uint8_t>(c + 32) : c);
        }
        ++i;
    }
}

// Per document (bytes offsets[i]..offsets[i+1] of data), the MinHash signature of its word ngrams-grams: each
// XXH64-hashed as its words joined by single spaces, then permuted_minima. The bytes are the words already joined
// by single spaces, or with simplify_ascii, raw ASCII text simplified here. Rows of documents with fewer than
// ngrams words stay all ones.
py::array_t<uint64_t> minhash_signatures(py::handle data_obj, py::handle offsets_obj, int64_t ngrams,
                                         py::handle a_obj, py::handle b_obj, bool ascii_text) {
    auto data = checked_array<uint8_t>(data_obj, "data", false);
    auto offsets = checked_array<int64_t>(offsets_obj, "offsets", false);
    auto a_arr = checked_array<uint64_t>(a_obj, "a", false);
    auto b_arr = checked_array<uint64_t>(b_obj, "b", false);
    if (ngrams < 1) throw py::value_error("ngrams must be >= 1");
    const int64_t n = offsets.shape(0) - 1, H = a_arr.shape(0);
    if (b_arr.shape(0) != H) throw py::value_error("a and b differ in length");
    py::array_t<uint64_t> out({std::max<int64_t>(n, 0), H});
    uint64_t *sig = out.mutable_data();
    std::fill(sig, sig + std::max<int64_t>(n, 0) * H, std::numeric_limits<uint64_t>::max());
    const uint64_t *a = a_arr.data(), *b = b_arr.data();
    auto o = offsets.unchecked<1>();
    for (int64_t i = 0; i < n; ++i) {
        if (o(i) < 0 || o(i + 1) < o(i) || o(i + 1) > data.shape(0)) throw py::value_error("offsets out of range");
    }
    const uint8_t *d = data.data();
    std::vector<int64_t> starts;
    std::vector<uint8_t> simplified;
    {
        py::gil_scoped_release release;
        for (int64_t i = 0; i < n; ++i) {
            const uint8_t *text = d + o(i);
            int64_t len = o(i + 1) - o(i);
            if (ascii_text) {
                simplify_ascii(text, len, simplified);
                text = simplified.data();
                len = static_cast<int64_t>(simplified.size());
            }
            if (len == 0) continue;
            starts.clear();
            starts.push_back(0);
            for (int64_t j = 0; j < len; ++j) {
                if (text[j] == ' ') starts.push_back(j + 1);
            }
            const int64_t words = static_cast<int64_t>(starts.size());
            starts.push_back(len + 1);  // one past the last word's (absent) trailing separator
            uint64_t *row = sig + i * H;
            for (int64_t w = 0; w + ngrams <= words; ++w) {
                const uint64_t h = xxh64(text + starts[w], static_cast<size_t>(starts[w + ngrams] - 1 - starts[w]));
                permuted_minima(a, b, H, h, row);
            }
        }
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "tokenloom native index builders";
    m.attr("ABI_VERSION") = 3;
    m.def("pack_best_fit", &pack_best_fit, kPackDoc, py::arg("sizes"), py::arg("doc_idx"), py::arg("capacity"),
          py::arg("step"));
    m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, kSampleIdxDoc, py::arg("sizes"), py::arg("doc_idx"),
          py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"), py::arg("drop_last") = true,
          py::arg("add_extra_token") = 1, py::arg("exact_ceil") = false);
    m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, kSampleIdxDoc, py::arg("sizes"), py::arg("doc_idx"),
          py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"), py::arg("drop_last") = true,
          py::arg("add_extra_token") = 1, py::arg("exact_ceil") = false);
    m.def("legacy_shuffle_int32", &legacy_shuffle<int32_t>, kShuffleDoc, py::arg("array"), py::arg("key"),
          py::arg("pos"));
    m.def("legacy_shuffle_uint32", &legacy_shuffle<uint32_t>, kShuffleDoc, py::arg("array"), py::arg("key"),
          py::arg("pos"));
    m.def("legacy_shuffle_int64", &legacy_shuffle<int64_t>, kShuffleDoc, py::arg("array"), py::arg("key"),
          py::arg("pos"));
    m.def("build_blending_indices", &build_blending_indices,
          "Fill dataset_index (int16) and dataset_sample_index (int64) by Megatron's greedy largest-error rule.",
          py::arg("dataset_index"), py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"),
          py::arg("size"), py::arg("verbose") = false);
    m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
          "Fill dataset_index / dataset_sample_index drawing every sample of every dataset exactly once.",
          py::arg("dataset_index"), py::arg("dataset_sample_index"), py::arg("sizes"), py::arg("num_datasets"));
    m.def("xxh64_array", &xxh64_array, "XXH64 (seed 0) of each byte range offsets[i]..offsets[i+1] of data (uint64[n]).",
          py::arg("data"), py::arg("offsets"));
    m.def("minhash_signatures", &minhash_signatures,
          "MinHash signatures (uint64[n, len(a)]) of documents given as space-joined words (see tokenloom.clean.keys).",
          py::arg("data"), py::arg("offsets"), py::arg("ngrams"), py::arg("a"), py::arg("b"),
          py::arg("ascii_text") = false);
}
