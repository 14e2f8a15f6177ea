// The AMX tile set-up both AMX kernels share: every one of the 8 tiles 16 rows of 64 bytes
// (16 x 32 bfloat16, or 16 x 16 float32), loaded once per thread before its tile work and
// released after it.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

constexpr int64_t kTileRows = 16;      // rows of every tile
constexpr int64_t kTileRowBytes = 64;  // 32 bfloat16 or 16 float32 a row

// The 64-byte tile configuration AMX's LDTILECFG reads (palette 1: 8 tiles of up to 16 rows of
// 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

[[gnu::target("amx-tile")]] inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = kTileRowBytes;
    config.rows[t] = kTileRows;
  }
  // GCC 12 does not see LDTILECFG read its operand and drops the stores above without this.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

[[gnu::target("amx-tile")]] inline void release_tiles() { _tile_release(); }

}  // namespace tokenmill
