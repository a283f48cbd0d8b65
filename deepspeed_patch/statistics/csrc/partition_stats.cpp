// Copyright (c) Microsoft Corporation.
// SPDX-License-Identifier: Apache-2.0

// DeepSpeed Team

// Per-bucket gradient statistics of one flat gradient partition in a single read, on the host; and those of an
// fp32 master partition, its Adam moments and the update the step made, in a single read of the three.
//
// The op folds every entry of a chunk list (start, length, bucket row) of a flat 1-D fp32, bf16 or fp16
// partition into a (buckets, 9) float64 table with the columns of statistics.py: SUMSQ, NONFINITE, L1,
// SUM, ZEROS, NUMEL (added up) and MAX, NEG_MIN, NEG_ABS_MIN (maxima). Each chunk is read once, all
// statistics together; the threads take contiguous ranges of chunks of about equal size, write one
// partial row per chunk, and the rows are folded into the table in chunk order, so the result does
// not depend on the number of threads. Elements are compared as float (exact for all three dtypes) and
// summed as double. A chunk with a NaN has NaN min, max and abs-min, and NaN stays in the table once
// there, as torch.aminmax and scatter_reduce(amax) do in partition_stats.accumulate_spans.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

enum Column : int { SUMSQ, NONFINITE, L1, SUM, ZEROS, NUMEL, MAX, NEG_MIN, NEG_ABS_MIN, NUM_COLUMNS };
constexpr int NUM_SUMMED = 6;
constexpr int64_t CHUNK_FIELDS = 3;  // start, length, bucket row
// Extra statistics, as bits of the op's `extra` argument.
constexpr int64_t WITH_L1 = 1, WITH_SUM = 2, WITH_ZEROS = 4;
// What a chunk costs beside its elements, in elements: evens out threads over many small chunks.
constexpr int64_t CHUNK_OVERHEAD = 64;
// Work (elements) below which one more thread costs more to start and join than it saves.
constexpr int64_t WORK_PER_THREAD = 1 << 18;

constexpr float INF = std::numeric_limits<float>::infinity();
constexpr double NAN64 = std::numeric_limits<double>::quiet_NaN();
constexpr uint32_t EXPONENT = 0x7f800000u, MAGNITUDE = 0x7fffffffu;

// Each input type: its storage and an exact, branch-free (vectorisable) conversion to float.
struct Float32 {
  using Raw = float;
  static inline float load(float value) { return value; }
};

struct BFloat16 {
  using Raw = uint16_t;
  static inline float load(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
};

struct Float16 {
  using Raw = uint16_t;
  // Normal numbers: move exponent and mantissa into place and rebias the exponent by 127 - 15.
  // Subnormals: mantissa times 2^-24, computed on normal floats (exact, and unaffected by DAZ/FTZ).
  static inline float load(uint16_t bits) {
    const uint32_t magnitude = bits & 0x7fffu, sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exponent = magnitude & 0x7c00u;
    const float normal = std::bit_cast<float>((magnitude << 13) + (112u << 23));
    const float subnormal = static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-24f;
    const float special = std::bit_cast<float>((magnitude << 13) | EXPONENT);
    const float value = exponent == 0 ? subnormal : (exponent == 0x7c00u ? special : normal);
    return std::bit_cast<float>(std::bit_cast<uint32_t>(value) | sign);
  }
};

// Element i of a chunk of one stored partition, as float.
template <class In>
struct Stored {
  const typename In::Raw* data;
  inline float operator()(int64_t i) const { return In::load(data[i]); }
};

template <class Load>
bool has_nan(const Load& load, int64_t length) {
  for (int64_t i = 0; i < length; ++i) {
    const float value = load(i);
    if (value != value) { return true; }
  }
  return false;
}

// The partial row of the `length` elements `load` gives. kExtra: also L1, sum and zeros (written only where
// asked for).
template <class Load, bool kExtra>
inline __attribute__((always_inline)) void chunk_row(const Load& load, int64_t length, int64_t extra, double* row) {
  double sumsq = 0.0, l1 = 0.0, sum = 0.0;
  int32_t nonfinite = 0, zeros = 0;  // a chunk is shorter than 2^31 elements (checked)
  float high = -INF, low = INF, abs_low = INF;
#pragma omp simd reduction(+ : sumsq, l1, sum, nonfinite, zeros) reduction(max : high) reduction(min : low, abs_low)
  for (int64_t i = 0; i < length; ++i) {
    const float value = load(i);
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    const float magnitude = std::bit_cast<float>(bits & MAGNITUDE);
    const double wide = value;
    sumsq += wide * wide;
    nonfinite += (bits & EXPONENT) == EXPONENT;
    high = std::max(high, value);
    low = std::min(low, value);
    abs_low = std::min(abs_low, magnitude);
    if constexpr (kExtra) {
      l1 += std::fabs(wide);
      sum += wide;
      zeros += value == 0.0f;
    }
  }
  // The vector min/max above skip or keep NaN at random: rescan the rare chunk with non-finite values.
  const bool nan = nonfinite > 0 && has_nan(load, length);
  row[SUMSQ] = sumsq;
  row[NONFINITE] = nonfinite;
  row[L1] = (extra & WITH_L1) ? l1 : 0.0;
  row[SUM] = (extra & WITH_SUM) ? sum : 0.0;
  row[ZEROS] = (extra & WITH_ZEROS) ? zeros : 0.0;
  row[NUMEL] = static_cast<double>(length);
  row[MAX] = nan ? NAN64 : static_cast<double>(high);
  row[NEG_MIN] = nan ? NAN64 : -static_cast<double>(low);
  row[NEG_ABS_MIN] = nan ? NAN64 : -static_cast<double>(abs_low);
}

template <class In, bool kExtra>
inline __attribute__((always_inline)) void range_rows(const void* flat, const int64_t* chunk_list, int64_t first,
                                                      int64_t last, int64_t extra, double* rows) {
  const auto* data = static_cast<const typename In::Raw*>(flat);
  for (int64_t chunk = first; chunk < last; ++chunk) {
    const int64_t* entry = chunk_list + chunk * CHUNK_FIELDS;
    chunk_row<Stored<In>, kExtra>(Stored<In>{data + entry[0]}, entry[1], extra, rows + chunk * NUM_COLUMNS);
  }
}

// The rows of chunks [first, last). Compiled for AVX-512, AVX2 and baseline x86-64, chosen at load time
// by the CPU, so that a build cached on one machine runs on any other (no -march=native).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void rows_of_chunks(int dtype, const void* flat, const int64_t* chunk_list, int64_t first, int64_t last, int64_t extra,
                    double* rows) {
  const bool with_extra = extra != 0;
  switch (dtype) {
    case 0:
      with_extra ? range_rows<Float32, true>(flat, chunk_list, first, last, extra, rows)
                 : range_rows<Float32, false>(flat, chunk_list, first, last, extra, rows);
      break;
    case 1:
      with_extra ? range_rows<BFloat16, true>(flat, chunk_list, first, last, extra, rows)
                 : range_rows<BFloat16, false>(flat, chunk_list, first, last, extra, rows);
      break;
    default:
      with_extra ? range_rows<Float16, true>(flat, chunk_list, first, last, extra, rows)
                 : range_rows<Float16, false>(flat, chunk_list, first, last, extra, rows);
  }
}

int dtype_code(const at::Tensor& flat) {
  switch (flat.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "partition_stats: flat partition must be fp32, bf16 or fp16, not ", flat.scalar_type());
  }
}

// Checks every entry of the chunk list against the partition and the statistics table; returns each chunk's
// cumulative cost (elements plus CHUNK_OVERHEAD), which the threads split evenly.
std::vector<int64_t> checked_costs(const int64_t* chunk_list, int64_t chunks, int64_t numel, int64_t buckets) {
  std::vector<int64_t> cumulative(chunks + 1, 0);
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t start = chunk_list[chunk * CHUNK_FIELDS], length = chunk_list[chunk * CHUNK_FIELDS + 1];
    const int64_t bucket = chunk_list[chunk * CHUNK_FIELDS + 2];
    TORCH_CHECK(start >= 0 && length >= 0 && length <= std::numeric_limits<int32_t>::max() && start <= numel - length,
                "partition_stats: chunk ", chunk, " (start ", start, ", length ", length,
                ") is outside the partition of ", numel, " elements");
    TORCH_CHECK(bucket >= 0 && bucket < buckets, "partition_stats: chunk ", chunk, " has bucket row ", bucket,
                " outside the table of ", buckets, " rows");
    cumulative[chunk + 1] = cumulative[chunk] + length + CHUNK_OVERHEAD;
  }
  return cumulative;
}

inline double nan_max(double current, double value) {
  return (std::isnan(current) || std::isnan(value)) ? NAN64 : std::max(current, value);
}

void fold_rows(double* stats, const int64_t* chunk_list, const double* rows, int64_t chunks) {
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    double* target = stats + chunk_list[chunk * CHUNK_FIELDS + 2] * NUM_COLUMNS;
    const double* row = rows + chunk * NUM_COLUMNS;
    for (int column = 0; column < NUM_SUMMED; ++column) { target[column] += row[column]; }
    for (int column = NUM_SUMMED; column < NUM_COLUMNS; ++column) {
      target[column] = nan_max(target[column], row[column]);
    }
  }
}

// Runs rows_of(first, last) for ranges of chunks, one per thread, each of about equal cost.
template <class RowsOf>
void over_threads(const std::vector<int64_t>& cumulative, int64_t count, const RowsOf& rows_of) {
  const int threads = static_cast<int>(
      std::min<int64_t>({at::get_num_threads(), count, 1 + cumulative.back() / WORK_PER_THREAD}));
#pragma omp parallel num_threads(threads)
  {
    // Thread `part` takes the chunks that end inside the `part`-th equal share of the total cost.
    const auto boundary = [&](int64_t part) {
      const int64_t share = cumulative.back() * part / omp_get_num_threads();
      return std::upper_bound(cumulative.begin() + 1, cumulative.end(), share) - (cumulative.begin() + 1);
    };
    const int part = omp_get_thread_num();
    rows_of(boundary(part), boundary(part + 1));
  }
}

void check_table(const at::Tensor& stats) {
  TORCH_CHECK(stats.device().is_cpu() && stats.scalar_type() == at::kDouble && stats.dim() == 2 &&
                  stats.size(1) == NUM_COLUMNS && stats.is_contiguous(),
              "partition_stats: stats must be a contiguous (buckets, 9) float64 host table");
}

void check_chunks(const at::Tensor& chunks) {
  TORCH_CHECK(chunks.device().is_cpu() && chunks.scalar_type() == at::kLong && chunks.dim() == 2 &&
                  chunks.size(1) == CHUNK_FIELDS && chunks.is_contiguous(),
              "partition_stats: chunk list must be a contiguous (chunks, 3) int64 host tensor");
}

void accumulate_chunks(at::Tensor stats, const at::Tensor& flat, const at::Tensor& chunks, int64_t extra) {
  check_table(stats);
  check_chunks(chunks);
  TORCH_CHECK(flat.device().is_cpu() && flat.dim() == 1 && flat.is_contiguous(),
              "partition_stats: flat partition must be 1-D, contiguous, on the host");
  const int dtype = dtype_code(flat);
  const int64_t count = chunks.size(0);
  const int64_t* chunk_list = chunks.data_ptr<int64_t>();
  const std::vector<int64_t> cumulative = checked_costs(chunk_list, count, flat.numel(), stats.size(0));
  if (count == 0) { return; }
  std::vector<double> rows(count * NUM_COLUMNS);
  const void* data = flat.data_ptr();
  over_threads(cumulative, count, [&](int64_t first, int64_t last) {
    rows_of_chunks(dtype, data, chunk_list, first, last, extra, rows.data());
  });
  fold_rows(stats.data_ptr<double>(), chunk_list, rows.data(), count);
}

// An Adam step's update, element by element, from the fp32 weights and moments after it, in the order of
// operations of optimizer_stats.AdamRule: a = m / (sqrt(v) / sqrt_bc2 + eps) * step_size, with decoupled weight
// decay a = (a + p * decay) / keep; the update is -a.
struct AdamRule {
  float step_size, sqrt_bc2, eps, decay, keep;
};

template <bool kDecoupled>
struct AdamUpdate {
  const float *param, *exp_avg, *exp_avg_sq;
  AdamRule rule;
  inline float operator()(int64_t i) const {
    float step = exp_avg[i] / (std::sqrt(exp_avg_sq[i]) / rule.sqrt_bc2 + rule.eps) * rule.step_size;
    if constexpr (kDecoupled) { step = (step + param[i] * rule.decay) / rule.keep; }
    return -step;
  }
};

// The optimizer statistics of one group, as bits of the op's `kinds` argument: their tables follow this order.
constexpr int64_t PARAM = 1, UPDATE = 2, EXP_AVG = 4, EXP_AVG_SQ = 8;

// The rows of chunks [first, last) of each requested kind: kind slot k's rows start at rows + k * count * 9.
// A chunk's three arrays stay in the core's cache while its four rows are computed: one read from memory.
template <bool kDecoupled>
inline __attribute__((always_inline)) void adam_range_rows(const float* param, const float* exp_avg,
                                                           const float* exp_avg_sq, const int64_t* chunk_list,
                                                           int64_t first, int64_t last, int64_t count,
                                                           AdamRule rule, int64_t kinds, double* rows) {
  using Fp32 = Stored<Float32>;
  for (int64_t chunk = first; chunk < last; ++chunk) {
    const int64_t start = chunk_list[chunk * CHUNK_FIELDS], length = chunk_list[chunk * CHUNK_FIELDS + 1];
    double* row = rows + chunk * NUM_COLUMNS;
    const int64_t stride = count * NUM_COLUMNS;
    if (kinds & PARAM) {
      chunk_row<Fp32, false>(Fp32{param + start}, length, 0, row);
      row += stride;
    }
    if (kinds & UPDATE) {
      const AdamUpdate<kDecoupled> update{param + start, exp_avg + start, exp_avg_sq + start, rule};
      chunk_row<AdamUpdate<kDecoupled>, false>(update, length, 0, row);
      row += stride;
    }
    if (kinds & EXP_AVG) {
      chunk_row<Fp32, false>(Fp32{exp_avg + start}, length, 0, row);
      row += stride;
    }
    if (kinds & EXP_AVG_SQ) { chunk_row<Fp32, false>(Fp32{exp_avg_sq + start}, length, 0, row); }
  }
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void adam_rows_of_chunks(const float* param, const float* exp_avg, const float* exp_avg_sq, const int64_t* chunk_list,
                         int64_t first, int64_t last, int64_t count, AdamRule rule, int64_t kinds, double* rows) {
  rule.decay != 0.0f
      ? adam_range_rows<true>(param, exp_avg, exp_avg_sq, chunk_list, first, last, count, rule, kinds, rows)
      : adam_range_rows<false>(param, exp_avg, exp_avg_sq, chunk_list, first, last, count, rule, kinds, rows);
}

void check_fp32_like(const at::Tensor& flat, const at::Tensor& param, const char* name) {
  TORCH_CHECK(flat.device().is_cpu() && flat.scalar_type() == at::kFloat && flat.dim() == 1 && flat.is_contiguous() &&
                  flat.numel() == param.numel(),
              "partition_stats: ", name, " must be a contiguous 1-D fp32 host tensor of the weights' length");
}

// Folds the requested kinds (bits of `kinds`) of one fp32 master partition, its Adam moments and the update the
// step made (`rule`: step_size, sqrt_bc2, eps, decay (0: none, or L2 in the gradient), keep = 1 - decay) into one
// table each, `stats` holding them in the order of the bits.
void accumulate_adam_chunks(at::TensorList stats, const at::Tensor& param, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, const at::Tensor& chunks, at::ArrayRef<double> rule,
                            int64_t kinds) {
  TORCH_CHECK(kinds > 0 && kinds < 16 && static_cast<int64_t>(stats.size()) == __builtin_popcountll(kinds),
              "partition_stats: one table per requested kind (kinds ", kinds, ", ", stats.size(), " tables)");
  TORCH_CHECK(rule.size() == 5, "partition_stats: the Adam rule has 5 coefficients, not ", rule.size());
  check_chunks(chunks);
  check_fp32_like(param, param, "the weights");
  check_fp32_like(exp_avg, param, "exp_avg");
  check_fp32_like(exp_avg_sq, param, "exp_avg_sq");
  for (const at::Tensor& table : stats) {
    check_table(table);
    TORCH_CHECK(table.size(0) == stats[0].size(0), "partition_stats: the kinds' tables differ in rows");
  }
  const int64_t count = chunks.size(0);
  const int64_t* chunk_list = chunks.data_ptr<int64_t>();
  const std::vector<int64_t> cumulative = checked_costs(chunk_list, count, param.numel(), stats[0].size(0));
  if (count == 0) { return; }
  const AdamRule coefficients{static_cast<float>(rule[0]), static_cast<float>(rule[1]), static_cast<float>(rule[2]),
                              static_cast<float>(rule[3]), static_cast<float>(rule[4])};
  std::vector<double> rows(stats.size() * count * NUM_COLUMNS);
  over_threads(cumulative, count, [&](int64_t first, int64_t last) {
    adam_rows_of_chunks(param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), chunk_list,
                        first, last, count, coefficients, kinds, rows.data());
  });
  for (size_t slot = 0; slot < stats.size(); ++slot) {
    fold_rows(stats[slot].data_ptr<double>(), chunk_list, rows.data() + slot * count * NUM_COLUMNS, count);
  }
}

}  // namespace

TORCH_LIBRARY(layer_grad_norms, m) {
  m.def("accumulate_chunks(Tensor(a!) stats, Tensor flat, Tensor chunks, int extra) -> ()", accumulate_chunks);
  m.def(
      "accumulate_adam_chunks(Tensor(a!)[] stats, Tensor param, Tensor exp_avg, Tensor exp_avg_sq, Tensor chunks, "
      "float[] rule, int kinds) -> ()",
      accumulate_adam_chunks);
}

// DeepSpeed's op builder (op_builder/layer_grad_norms.py) imports the library as a Python module: the ops above
// are registered when it loads, the module holds nothing.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
