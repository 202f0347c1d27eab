// Attention of several new tokens per sequence over a paged KV cache, fp32 or bf16 (q, cache and
// out alike; a.bf16: q widened to fp32 as it is copied to the scratch, K/V as loaded, out rounded
// once), or fp32 q and out over a bf16 cache (a.kv_bf16), for prefill chunks and speculative
// verification, with an optional token tree.
//
// Sequence b owns query rows [cu[b], cu[b + 1]) (n_b rows) and has ctx_b tokens in the cache, the
// last n_b of which are its new tokens (their K/V were written before the call). With P = ctx_b - n_b,
// new token i (0 <= i < n_b) sits at position P + i and sees
//   - every cached token t < P, and
//   - causal: the new tokens j <= i;  tree: the new tokens j that are ancestors of i (or i itself),
//     where parents[cu[b] + i] in [-1, i) is i's parent among the new tokens (-1: the prefix).
// For query head h (kv head g = h / (H / G)):
//   out[row, h] = sum_t softmax_t(scale * <q[row, h], K[slot(b, t), g]>) V[slot(b, t), g]
//   lse[row, h] = log sum_t exp(scale * <q, K_t>)            (natural log; -inf if nothing is seen)
//
// Work item = (b, block of <= kQBlock queries, key range). Per kv head the item's queries x H/G heads
// form R rows sharing every K/V run loaded (the register-tiled primitives of attention_prims.h run
// over all R rows), and keys are consumed in chunks of kChunk with an online softmax (flash
// attention: running max m, sum l, unnormalised acc rescaled by exp(m_old - m_new)). When there are
// fewer query blocks than threads, long key ranges are split across items and merged exactly:
//   M = max_p m_p;  out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_prims.h"
#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

using namespace attn;

constexpr int64_t kQBlock = 16;                 // queries per work item
constexpr int64_t kChunk = 128;                 // keys per online-softmax step
constexpr int64_t kMinSplit = 256;              // shortest key range worth its own work item
constexpr int64_t kMinParallelWork = 1 << 17;   // sum(rows x keys) * D below which one thread wins
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t idx(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

struct Item {
  int64_t b, i0, i1, t0, t1;  // queries [i0, i1) of sequence b (0-based), keys [t0, t1)
};

struct Seq {
  int64_t row0, n, prefix;  // first query row, new tokens, cached tokens before them
  int64_t anc_off;          // offset of its n x n ancestor matrix in the tree buffer (tree only)
};

// Walks keys [t0, t1) of sequence b as runs of <= kRun consecutive slots within one block; calls
// f(offset from t0, first slot, run length).
template <typename F>
inline void for_each_run(const VarlenAttnArgs& a, int64_t b, int64_t t0, int64_t t1, F&& f) {
  int64_t j = t0 / a.block_size, off = t0 % a.block_size;
  for (int64_t t = t0; t < t1;) {
    const int64_t n = std::min({a.block_size - off, t1 - t, kRun});
    f(t - t0, idx(a.block_tables, a.bt_is64, b * a.bt_sb + j) * a.block_size + off, n);
    t += n;
    off += n;
    if (off == a.block_size) off = 0, ++j;
  }
}

struct Scratch {
  std::vector<float> q, s, acc, m, l;
  void fit(int64_t R, int64_t D) {  // grow only (a later call may need more rows or a wider D)
    if (static_cast<int64_t>(q.size()) < R * D) q.resize(R * D), acc.resize(R * D);
    if (static_cast<int64_t>(m.size()) < R) s.resize(R * kChunk), m.resize(R), l.resize(R);
  }
};

// Rows of the item for kv head g: r = (i - i0) * hpg + hh, i.e. query i, head g * hpg + hh.
// Results: m/l[(i - i0) * H + h] and acc[((i - i0) * H + h) * D + d] (unnormalised).
template <typename T, typename C>  // q's element type, the cache's
void run_item(const VarlenAttnArgs& a, const Prims<C>& pr, const Seq& sq, const uint8_t* anc, const Item& it, float* m_out,
              float* l_out, float* acc_out) {
  const int64_t H = a.H, D = a.D, hpg = H / a.G, nq = it.i1 - it.i0, R = nq * hpg;
  static thread_local Scratch sc;
  sc.fit(R, D);
  float *qb = sc.q.data(), *s = sc.s.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
  for (int64_t g = 0; g < a.G; ++g) {
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t hh = 0; hh < hpg; ++hh) {
        const T* src = static_cast<const T*>(a.q) + (sq.row0 + it.i0 + i) * a.q_st + (g * hpg + hh) * a.q_sh;
        float* dst = qb + (i * hpg + hh) * D;
        if constexpr (sizeof(T) == 4) {
          std::memcpy(dst, src, D * sizeof(float));
        } else {
          for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(src[d]);
        }
      }
    std::fill_n(acc, R * D, 0.f);
    std::fill_n(m, R, kNegInf);
    std::fill_n(l, R, 0.f);
    const C* kg = static_cast<const C*>(a.k_cache) + g * a.k_sg;
    const C* vg = static_cast<const C*>(a.v_cache) + g * a.v_sg;
    for (int64_t c0 = it.t0; c0 < it.t1; c0 += kChunk) {
      const int64_t c1 = std::min(c0 + kChunk, it.t1), len = c1 - c0;
      for_each_run(a, it.b, c0, c1, [&](int64_t o, int64_t slot, int64_t n) {
        pr.scores(qb, D, R, kg + slot * a.k_ss, a.k_ss, n, D, a.scale, s + o, kChunk);
      });
      // Mask keys a query may not see: past its own position, or (tree) new tokens not its ancestors.
      // Chunks entirely in the prefix, or before every query's diagonal (causal), need none.
      const bool tail = anc ? c1 > sq.prefix : c1 > sq.prefix + it.i0 + 1;
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s + r * kChunk;
        if (tail) {
          const int64_t i = it.i0 + r / hpg;
          if (anc) {
            for (int64_t t = std::max(c0, sq.prefix); t < c1; ++t) {
              const int64_t j = t - sq.prefix;
              if (j > i || !anc[sq.anc_off + i * sq.n + j]) sr[t - c0] = kNegInf;
            }
          } else {  // causal: keys after the query's own position, one contiguous run
            const int64_t from = std::max(c0, sq.prefix + i + 1);
            if (from < c1) std::fill(sr + (from - c0), sr + (c1 - c0), kNegInf);
          }
        }
        const float mn = std::max(m[r], pr.rowmax(sr, len));
        if (mn == kNegInf) {  // nothing visible to this row yet: contributes nothing
          std::fill_n(sr, len, 0.f);
          continue;
        }
        const float alpha = std::exp(m[r] - mn);  // 0 on the first visible chunk
        l[r] = l[r] * alpha + pr.expsum(sr, len, mn);
        if (alpha != 1.f)
          for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= alpha;
        m[r] = mn;
      }
      for_each_run(a, it.b, c0, c1, [&](int64_t o, int64_t slot, int64_t n) {
        pr.accum(s + o, kChunk, R, n, vg + slot * a.v_ss, a.v_ss, D, acc);
      });
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t hh = 0; hh < hpg; ++hh) {
        const int64_t r = i * hpg + hh, dst = i * H + g * hpg + hh;
        m_out[dst] = m[r], l_out[dst] = l[r];
        std::memcpy(acc_out + dst * D, acc + r * D, D * sizeof(float));
      }
  }
}

// Final rows of items [i, j) (same sequence and query block): merge partials, normalise, write.
template <typename T>
void finish(const VarlenAttnArgs& a, const Seq& sq, const std::vector<Item>& items, const float* part,
            int64_t per_item, int64_t rows_per_item, int64_t i, int64_t j) {
  const int64_t H = a.H, D = a.D, nq = items[i].i1 - items[i].i0;
  std::vector<float> tmp(sizeof(T) == 4 ? 0 : D);  // bf16: the row in fp32, rounded once at the end
  for (int64_t r = 0; r < nq * H; ++r) {
    const int64_t row = sq.row0 + items[i].i0 + r / H, h = r % H;
    float M = kNegInf;
    for (int64_t p = i; p < j; ++p) M = std::max(M, part[p * per_item + r]);
    T* out = static_cast<T*>(a.out) + row * a.o_st + h * a.o_sh;
    float* o;
    if constexpr (sizeof(T) == 4) {
      o = out;
    } else {
      o = tmp.data();
    }
    std::fill_n(o, D, 0.f);
    float L = 0.f;
    if (M != kNegInf)
      for (int64_t p = i; p < j; ++p) {
        const float* pp = part + p * per_item;
        const float w = std::exp(pp[r] - M);
        L += w * pp[rows_per_item + r];
        const float* acc = pp + 2 * rows_per_item + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
      }
    if (L > 0.f) {
      const float inv = 1.0f / L;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
    if constexpr (sizeof(T) != 4)
      for (int64_t d = 0; d < D; ++d) out[d] = from_f32<T>(o[d]);
    if (a.lse) a.lse[row * a.lse_st + h] = L > 0.f ? M + std::log(L) : kNegInf;
  }
}

}  // namespace

std::string varlen_attention_validate(const VarlenAttnArgs& a) {
  if (idx(a.cu_seqlens, a.cu_is64, 0) != 0) return "cu_seqlens_q[0] must be 0";
  if (idx(a.cu_seqlens, a.cu_is64, a.B) != a.T)
    return "cu_seqlens_q[-1] = " + std::to_string(idx(a.cu_seqlens, a.cu_is64, a.B)) + " must equal the " +
           std::to_string(a.T) + " query rows";
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t r0 = idx(a.cu_seqlens, a.cu_is64, b), n = idx(a.cu_seqlens, a.cu_is64, b + 1) - r0;
    const int64_t ctx = idx(a.context_lens, a.cl_is64, b);
    const std::string sb = std::to_string(b);
    if (n < 0) return "cu_seqlens_q must be non-decreasing (at sequence " + sb + ")";
    if (ctx < n)
      return "context_lens[" + sb + "] = " + std::to_string(ctx) + " is less than its " + std::to_string(n) +
             " new tokens (the new tokens' K/V must be in the cache)";
    const int64_t nblk = (ctx + a.block_size - 1) / a.block_size;
    if (nblk > a.max_blocks)
      return "sequence " + sb + " has " + std::to_string(ctx) + " tokens = " + std::to_string(nblk) +
             " blocks but block_tables has " + std::to_string(a.max_blocks) + " columns";
    for (int64_t j = 0; j < nblk; ++j) {
      const int64_t blk = idx(a.block_tables, a.bt_is64, b * a.bt_sb + j);
      const int64_t last = std::min(a.block_size, ctx - j * a.block_size) - 1;
      if (blk < 0 || blk * a.block_size + last >= a.S)
        return "block_tables[" + sb + ", " + std::to_string(j) + "] = " + std::to_string(blk) +
               " is outside the cache (" + std::to_string(a.S) + " slots of block_size " +
               std::to_string(a.block_size) + ")";
    }
    if (a.tree_parents)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = idx(a.tree_parents, a.tp_is64, r0 + i);
        if (p < -1 || p >= i)
          return "tree_parents[" + std::to_string(r0 + i) + "] = " + std::to_string(p) + " must be in [-1, " +
                 std::to_string(i) + ") (a parent comes before its child within sequence " + sb + ")";
      }
  }
  return "";
}

namespace {

template <typename T, typename C>
void varlen_attention(const VarlenAttnArgs& a, int max_threads) {
  const Prims<C> pr = prims_for<C>(active_isa());
  const int64_t H = a.H, D = a.D;
  std::vector<Seq> seqs(a.B);
  int64_t anc_size = 0, work = 0, n_blocks = 0;
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t r0 = idx(a.cu_seqlens, a.cu_is64, b), n = idx(a.cu_seqlens, a.cu_is64, b + 1) - r0;
    seqs[b] = {r0, n, idx(a.context_lens, a.cl_is64, b) - n, anc_size};
    if (a.tree_parents) anc_size += n * n;
    work += n * (seqs[b].prefix + (n + 1) / 2) * H;
    n_blocks += (n + kQBlock - 1) / kQBlock;
  }
  // anc[i * n + j] = 1 iff new token j is i or an ancestor of i (parents come first, so row p is
  // complete when row i copies it).
  std::vector<uint8_t> anc(anc_size, 0);
  for (int64_t b = 0; b < a.B && a.tree_parents; ++b) {
    uint8_t* A = anc.data() + seqs[b].anc_off;
    const int64_t n = seqs[b].n;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = idx(a.tree_parents, a.tp_is64, seqs[b].row0 + i);
      if (p >= 0) std::memcpy(A + i * n, A + p * n, n);
      A[i * n + i] = 1;
    }
  }
  const int nt = pick_threads(max_threads, work * D, kMinParallelWork, std::max<int64_t>(n_blocks, 2));
  // Split key ranges only when the query blocks alone cannot keep the threads busy (~4 items each).
  const int64_t target = 4 * nt;
  std::vector<Item> items;
  for (int64_t b = 0; b < a.B; ++b) {
    const Seq& sq = seqs[b];
    for (int64_t i0 = 0; i0 < sq.n; i0 += kQBlock) {
      const int64_t i1 = std::min(i0 + kQBlock, sq.n), kend = sq.prefix + i1;
      int64_t parts = 1;
      if (nt > 1 && n_blocks < target)
        parts = std::max<int64_t>(1, std::min((target + n_blocks - 1) / n_blocks, kend / kMinSplit));
      for (int64_t p = 0; p < parts; ++p) items.push_back({b, i0, i1, kend * p / parts, kend * (p + 1) / parts});
    }
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t rows = kQBlock * H, per_item = rows * (D + 2);  // m[rows], l[rows], acc[rows * D]
  std::vector<float> part(n_items * per_item);
  const uint8_t* A = a.tree_parents ? anc.data() : nullptr;
  auto run = [&](int64_t i) {
    float* p = part.data() + i * per_item;
    run_item<T, C>(a, pr, seqs[items[i].b], A, items[i], p, p + rows, p + 2 * rows);
  };
  if (nt == 1 || n_items == 1) {
    for (int64_t i = 0; i < n_items; ++i) run(i);
  } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) run(i);
  }
  std::vector<std::pair<int64_t, int64_t>> groups;  // [i, j): the items of one (sequence, query block)
  for (int64_t i = 0; i < n_items;) {
    int64_t j = i + 1;
    while (j < n_items && items[j].b == items[i].b && items[j].i0 == items[i].i0) ++j;
    groups.emplace_back(i, j);
    i = j;
  }
  const int64_t ng = static_cast<int64_t>(groups.size());
  parallel_for(pick_threads(nt, a.T * H * D, kMinParallelWork, ng), ng, [&](int64_t gi) {
    const auto [i, j] = groups[gi];
    finish<T>(a, seqs[items[i].b], items, part.data(), per_item, rows, i, j);
  });
}

}  // namespace

void varlen_paged_attention(const VarlenAttnArgs& a, int max_threads) {
  if (a.bf16) {
    varlen_attention<bf16_t, bf16_t>(a, max_threads);
  } else if (a.kv_bf16) {
    varlen_attention<float, bf16_t>(a, max_threads);
  } else {
    varlen_attention<float, float>(a, max_threads);
  }
}

}  // namespace duet
