// y [M, N] = x [M, K] @ W [N, K]^T (+ bias) in fp32 with FMA, on AVX2 or AVX-512, for an fp32
// model's steps of up to f32_panel_gemm_max_rows() rows (gemv.cpp): outer products on W
// packed in column panels, as panel_gemm.h does for bf16. A panel is 16 output columns by all
// of K (36 KB for K = 576), one 64-byte line per K step, the same layout on every build.
//
// A tile keeps 2 vectors of sums per row of x: on AVX2 one panel's 16 columns for 6 rows (12
// of its 16 registers), on AVX-512 two adjacent panels' 32 columns for 12 rows (24 of 32),
// beside 2 W vectors and a broadcast of x; it reads its panels from L2 once per tile. K runs
// in chunks of at most kF32ChunkSteps, each chunk's sums added to the last's in y, so that
// a tile's panels and rows of x stay in L2 for wide layers too (K = 8,192: a pair of whole
// panels is 1 MB, a Zen 4 core's L2).
//
// SmolLM2's 30 layers' linears and its head in fp32 (538 MB, from DRAM), 2 threads, medians:
// - the Zen 4 EPYC running the AVX2 code, oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2: the
//   Zen 3's FMA rate per core), ms: 1 / 2 / 4 rows 17.2 / 17.4 / 18.6 (the row-major GEMV
//   16.7 / 19.2 / 24.8), 8 rows 22.8 against oneDNN's 69.9, 16 29.8 against 67.6, 32 56.5
//   against 71.9, 64 115 against 125; 96-512 rows 1.1-1.3x, 1,024-2,048 1.05-1.1x. A Llama-3.2-1B-like
//   stack (K 2,048 and 8,192): 1-16 rows 1.3-1.6x oneDNN, 64-256 level, 1,024 1.17x.
// - the Zen 4 EPYC's own AVX-512 build against oneDNN's AVX-512 code: docs/benchmarks.md,
//   "fp32 panels on AVX-512".
#pragma once

#include "panel_layout.h"
#include "stream_prefetch.h"
#include "transpose16.h"
#include "transpose8.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_F32_PANEL_GEMM 1
#include <immintrin.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace pdserve_cpu {

// Panels [panel_begin, panel_end) of [N / 16][K][16] from W [N, K] row-major: panel p holds
// columns [p * 16, p * 16 + 16), K outermost.
inline void pack_f32_panels(const float* w, float* panels, int64_t K, int64_t panel_begin, int64_t panel_end) {
  for (int64_t p = panel_begin; p < panel_end; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kF32PanelCols; ++c)
        panels[(p * K + k) * kF32PanelCols + c] = w[(p * kF32PanelCols + c) * K + k];
}

// This build's fp32 vector: its type, lanes and the five operations a tile needs.
#if defined(__AVX512F__)
struct F32Vec {
  using type = __m512;
  static constexpr int64_t kLanes = 16;
  static type zero() { return _mm512_setzero_ps(); }
  static type load(const float* p) { return _mm512_loadu_ps(p); }
  static type broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static type fmadd(type a, type b, type c) { return _mm512_fmadd_ps(a, b, c); }
  static type add(type a, type b) { return _mm512_add_ps(a, b); }
  static void store(float* p, type v) { _mm512_storeu_ps(p, v); }
};
constexpr int64_t kF32TileRows = 12;  // 24 accumulators of AVX-512's 32 registers
#else
struct F32Vec {
  using type = __m256;
  static constexpr int64_t kLanes = 8;
  static type zero() { return _mm256_setzero_ps(); }
  static type load(const float* p) { return _mm256_loadu_ps(p); }
  static type broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static type fmadd(type a, type b, type c) { return _mm256_fmadd_ps(a, b, c); }
  static type add(type a, type b) { return _mm256_add_ps(a, b); }
  static void store(float* p, type v) { _mm256_storeu_ps(p, v); }
};
constexpr int64_t kF32TileRows = 6;  // 12 accumulators of AVX2's 16 registers
#endif
constexpr int64_t kF32PanelVecs = kF32PanelCols / F32Vec::kLanes;  // vectors across a panel
constexpr int64_t kF32TileVecs = 2;                                 // vectors of sums per row
constexpr int64_t kF32TilePanels = kF32TileVecs / kF32PanelVecs;     // panels a tile spans: 1 or 2
// K steps per chunk at most: a tile's chunk of panels 128 KB (AVX2) or 256 KB (AVX-512), its
// rows of x 48 KB, both read again by every tile from L2.
constexpr int64_t kF32ChunkSteps = 2048;
// Steps of at least this many rows ask for the next chunk into L2 while their first tile
// reads this one (as panel_gemm.h's whole tiles do); fewer stream W non-temporally a few KB
// ahead. On the Zen 4 running the AVX2 code, 1 / 2 rows 17.2 / 17.4 ms streaming against
// 18.9 / 18.6 with the L2 prefetch; 3 / 4 / 5 rows 20.8 / 21.3 / 22.7 streaming against
// 18.8 / 18.6 / 18.0.
constexpr int64_t kF32PrefetchMinRows = 3;

// x [M, K] as the tiles read it: each tile's rows (kF32TileRows, the last tile the rest)
// interleaved, [K][rows], at m0 * K, so that a K step's broadcasts read one line, from one
// pointer, where rows apart would take one register each. A tile's rows are read side by side,
// a vector of K steps from each (16 on AVX-512, 8 on AVX2; rows past the tile's read as zeros),
// transposed in registers (transpose16.h, transpose8.h), and each K step's values stored
// with a mask of the tile's rows: a tile of 12 rows by 576 steps 4.5 -> 2.15 us, by 1,536
// 12.0 -> 5.3 us on one Zen 5 core, against a value at a time (the decode loop's 64-row steps
// spent 3.4% of their time packing; a row at a time, each row's values rows apart, had taken
// 2-2.5x as long as a value at a time). K's last steps short of a vector: a value at a time.
inline void pack_f32_x_tile(const float* rows, float* tile, int64_t K, int64_t num_rows) {
  int64_t k = 0;
#if defined(PDSERVE_TRANSPOSE16)
  const __mmask16 tile_rows = static_cast<__mmask16>((1u << num_rows) - 1);
  for (; k + 16 <= K; k += 16) {
    __m512i steps[16], values[16];  // steps[i]: row i's 16 K steps; values[c]: K step k + c's rows
    for (int64_t i = 0; i < 16; ++i)
      steps[i] = i < num_rows ? _mm512_loadu_si512(static_cast<const void*>(rows + i * K + k)) : _mm512_setzero_si512();
    transpose_words16(steps, values);
    for (int64_t c = 0; c < 16; ++c) _mm512_mask_storeu_epi32(tile + (k + c) * num_rows, tile_rows, values[c]);
  }
#elif defined(PDSERVE_TRANSPOSE8)
  const __m256i tile_rows = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(num_rows)),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (; k + 8 <= K; k += 8) {
    __m256 steps[8], values[8];  // steps[i]: row i's 8 K steps; values[c]: K step k + c's rows
    for (int64_t i = 0; i < 8; ++i) steps[i] = i < num_rows ? _mm256_loadu_ps(rows + i * K + k) : _mm256_setzero_ps();
    transpose_floats8(steps, values);
    for (int64_t c = 0; c < 8; ++c) _mm256_maskstore_ps(tile + (k + c) * num_rows, tile_rows, values[c]);
  }
#endif
  for (; k < K; ++k)
    for (int64_t i = 0; i < num_rows; ++i) tile[k * num_rows + i] = rows[i * K + k];
}

// x's rows in tiles of kF32TileRows (RowTiles): on AVX-512 a rest of 1 or 2 rows joins the
// tile before it (13 or 14 rows: 26 or 28 accumulators, 2 W vectors and a broadcast still fit
// the 32 registers); AVX2's 16 registers hold no more than a tile.
#if defined(__AVX512F__)
constexpr int64_t kF32MaxJoinedTail = 2;
#else
constexpr int64_t kF32MaxJoinedTail = 0;
#endif
static_assert(kF32TileRows + kF32MaxJoinedTail <= F32Vec::kLanes, "pack_f32_x_tile transposes a tile's rows as lanes");

inline RowTiles f32_row_tiles(int64_t M) { return RowTiles(M, kF32TileRows, kF32MaxJoinedTail); }

inline int64_t num_f32_x_tiles(int64_t M) { return f32_row_tiles(M).count; }

inline void pack_f32_x_tiles(const float* x, float* x_tiles, int64_t M, int64_t K, int64_t tile_begin,
                             int64_t tile_end) {
  const RowTiles tiles = f32_row_tiles(M);
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t m0 = tiles.first(t);
    pack_f32_x_tile(x + m0 * K, x_tiles + m0 * K, K, tiles.rows(t));
  }
}

// What every tile of one call shares.
struct F32PanelGemm {
  const float* x_tiles;  // x as pack_f32_x_tiles lays it out
  const float* panels;   // [N / 16, K, 16]
  const float* bias;    // [N] or null
  float* y;             // [M, N]
  int64_t M, K, N;
};

// y rows [m0, m0 + RM), the NP panels' columns from panel p, over K steps [k0, k0 + num_steps):
// sums from zero on the first chunk, else from y; the bias added on the last. `ahead`: the
// next chunk (panel j's part panel_values floats on), asked for into L2 one line per panel
// and K step, or null; stream_ahead (where `ahead` is null): the panels' stream asked for
// non-temporally a few KB on (stream_prefetch.h).
//
// The loops over rows and vectors are unrolled by pragma: without it GCC 12 (-O3, AVX2)
// unrolls them too late to keep acc in registers only, and stores all accumulators to the
// stack at every K step besides.
template <int RM, int NP>
inline void f32_panel_tile(const F32PanelGemm& g, int64_t p, int64_t m0, int64_t k0, int64_t num_steps,
                           const char* ahead, bool stream_ahead) {
  constexpr int V = NP * kF32PanelVecs;
  using Vec = F32Vec;
  const int64_t panel_values = g.K * kF32PanelCols;
  const float* chunk = g.panels + p * panel_values + k0 * kF32PanelCols;
  const float* x_tile = g.x_tiles + m0 * g.K + k0 * RM;  // [num_steps][RM]
  float* y_rows = g.y + m0 * g.N + p * kF32PanelCols;
  Vec::type acc[RM][V];
#pragma GCC unroll 16
  for (int i = 0; i < RM; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[i][v] = k0 == 0 ? Vec::zero() : Vec::load(y_rows + i * g.N + v * Vec::kLanes);
  for (int64_t k = 0; k < num_steps; ++k) {
    Vec::type w[V];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      const float* w_line = chunk + j * panel_values + k * kF32PanelCols;  // panel j's 16 columns' W[., k]
#pragma GCC unroll 2
      for (int c = 0; c < kF32PanelVecs; ++c) w[j * kF32PanelVecs + c] = Vec::load(w_line + c * Vec::kLanes);
      if (ahead != nullptr)
        _mm_prefetch(ahead + (j * panel_values + k * kF32PanelCols) * sizeof(float), _MM_HINT_T1);
      else if (stream_ahead)
        prefetch_stream_ahead(w_line, kF32PanelCols * sizeof(float));
    }
#pragma GCC unroll 16
    for (int i = 0; i < RM; ++i) {
      const Vec::type x_k = Vec::broadcast(x_tile + k * RM + i);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[i][v] = Vec::fmadd(x_k, w[v], acc[i][v]);
    }
  }
  if (g.bias != nullptr && k0 + num_steps == g.K) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      const Vec::type bias = Vec::load(g.bias + p * kF32PanelCols + v * Vec::kLanes);
#pragma GCC unroll 16
      for (int i = 0; i < RM; ++i) acc[i][v] = Vec::add(acc[i][v], bias);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RM; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) Vec::store(y_rows + i * g.N + v * Vec::kLanes, acc[i][v]);
}

// NP panels from p over one chunk of K, against every row of x; the first tile asks for `ahead`.
template <int NP>
inline void f32_panel_chunk(const F32PanelGemm& g, int64_t p, int64_t k0, int64_t num_steps, const char* ahead,
                            bool stream_ahead) {
  const RowTiles tiles = f32_row_tiles(g.M);
  for (int64_t t = 0; t < tiles.count; ++t, ahead = nullptr) {
    const int64_t m0 = tiles.first(t);
    const bool stream = stream_ahead && t + 1 == tiles.count;  // (steps of few rows: one tile)
    switch (tiles.rows(t)) {
#define PDSERVE_F32_PANEL_TILE(r) \
  case r: f32_panel_tile<r, NP>(g, p, m0, k0, num_steps, ahead, stream); break;
      PDSERVE_F32_PANEL_TILE(1) PDSERVE_F32_PANEL_TILE(2) PDSERVE_F32_PANEL_TILE(3) PDSERVE_F32_PANEL_TILE(4)
      PDSERVE_F32_PANEL_TILE(5) PDSERVE_F32_PANEL_TILE(6)
#if defined(__AVX512F__)
      PDSERVE_F32_PANEL_TILE(7) PDSERVE_F32_PANEL_TILE(8) PDSERVE_F32_PANEL_TILE(9) PDSERVE_F32_PANEL_TILE(10)
      PDSERVE_F32_PANEL_TILE(11) PDSERVE_F32_PANEL_TILE(12) PDSERVE_F32_PANEL_TILE(13) PDSERVE_F32_PANEL_TILE(14)
#endif
#undef PDSERVE_F32_PANEL_TILE
      default: break;
    }
  }
}

// Panels [panel_begin, panel_end) for every row of x, kF32TilePanels at a time (a last odd
// one alone), K in equal chunks of at most kF32ChunkSteps: each chunk against all tiles of x
// rows before the next, which its first tile asks for.
inline void f32_panel_gemm_panels(const F32PanelGemm& g, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_values = g.K * kF32PanelCols;
  const bool stream_ahead = g.M < kF32PrefetchMinRows;
  const int64_t num_chunks = (g.K + kF32ChunkSteps - 1) / kF32ChunkSteps;
  const int64_t chunk_steps = (g.K + num_chunks - 1) / num_chunks;
  for (int64_t p = panel_begin; p < panel_end; p += kF32TilePanels) {
    const int64_t num_panels = std::min(kF32TilePanels, panel_end - p);
    for (int64_t k0 = 0; k0 < g.K; k0 += chunk_steps) {
      const int64_t num_steps = std::min(chunk_steps, g.K - k0);
      // The next chunk: the next part of these panels, else the next panels' first.
      const float* next = k0 + num_steps < g.K ? g.panels + p * panel_values + (k0 + num_steps) * kF32PanelCols
                          : p + num_panels < panel_end ? g.panels + (p + num_panels) * panel_values
                                                       : nullptr;
      const char* ahead = stream_ahead ? nullptr : reinterpret_cast<const char*>(next);
      if constexpr (kF32TilePanels == 2) {
        if (num_panels == 2) {
          f32_panel_chunk<2>(g, p, k0, num_steps, ahead, stream_ahead);
          continue;
        }
      }
      f32_panel_chunk<1>(g, p, k0, num_steps, ahead, stream_ahead);
    }
  }
}

// Steps of more rows than this run in blocks of rows (f32_panel_gemm_rows), each thread its
// own rows; up to it each thread takes a run of whole panels against every row (the form the
// native decode loop's region runs too). Row for row both make the same sums in the same
// order, so a row's bits do not depend on the step it is in.
constexpr int64_t kF32UnblockedMaxRows = 128;
// A block's rows of x, packed, take a quarter of the core's L2 (256 KB of a 1 MB one), beside
// a chunk of the panels a tile spans (one panel on AVX2, two on AVX-512: 36-72 KB at K = 576,
// 98-196 KB at 1,536) and the next chunk asked for. Unblocked, a 2,048-row step packed all of
// x (4.7 MB at K = 576) and each panel's tiles read it back from L3. On the Zen 5 EPYC held to
// AVX2 (2 threads, SmolLM2's shapes, 2,048 rows) that ran at 0.88-0.99x oneDNN's AVX2 code,
// blocked at 0.98-1.0x; at a quarter of L2 it ran ~1% ahead of an eighth.
inline int64_t f32_block_bytes() {
  static const int64_t l2_bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2_bytes > 0 ? l2_bytes / 4 : int64_t{256} << 10;
}

// Rows of x a block holds for K: whole tiles, at least one.
inline int64_t f32_block_rows(int64_t K) {
  const int64_t rows = f32_block_bytes() / (K * int64_t{sizeof(float)});
  return std::max<int64_t>(kF32TileRows, rows / kF32TileRows * kF32TileRows);
}

// Floats of the buffer f32_panel_gemm_rows packs a block into (a last block may take the 1 or 2
// rows after it, as a tile does: kF32MaxJoinedTail).
inline int64_t f32_block_floats(int64_t K) { return (f32_block_rows(K) + kF32MaxJoinedTail) * K; }

// Rows [row_begin, row_end) of y [M, N] = x [M, K] @ W^T (+ bias), every panel: block by
// block, the block's rows of x packed into x_block (f32_block_floats(K)), then every panel
// against its tiles: a panel from L3 once per block, from L2 for the block's other tiles.
inline void f32_panel_gemm_rows(const float* x, const float* panels, const float* bias, float* y, int64_t K,
                                int64_t N, int64_t row_begin, int64_t row_end, float* x_block) {
  const int64_t block_rows = f32_block_rows(K);
  for (int64_t m0 = row_begin; m0 < row_end;) {
    const int64_t rest = row_end - m0;
    const int64_t num_rows = rest <= block_rows + kF32MaxJoinedTail ? rest : block_rows;
    pack_f32_x_tiles(x + m0 * K, x_block, num_rows, K, 0, num_f32_x_tiles(num_rows));
    const F32PanelGemm block{x_block, panels, bias, y + m0 * N, num_rows, K, N};
    f32_panel_gemm_panels(block, 0, N / kF32PanelCols);
    m0 += num_rows;
  }
}

}  // namespace pdserve_cpu
#endif
