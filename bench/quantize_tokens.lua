-- SPDX-License-Identifier: MIT
-- moe_quantize's token kind on the FP8 layer's tokens (Kimi K2, 8 ranks x 7,168 tokens, H 7168,
-- bf16), on a GPU: the whole-block path (H a multiple of 128, aligned: four values a lane in one
-- load and one store) against the general kernel, reached by the same call on a view 4
-- bytes off the 8-byte alignment the whole-block path needs.  From the repository root, with ./build:
--
--   lua5.4 bench/quantize_tokens.lua [device]       (default cuda:0)
--
-- Prints the median of 30 calls after 3 warm-ups (device events) and the bytes moved a second
-- (bf16 read, e4m3 and the f32 scales written).
local build = os.getenv("MOE_BUILD_DIR") or "build"
package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path
package.cpath = "./" .. build .. "/?.so;" .. package.cpath

local moe = require "moelab"
local dev = arg[1] or "cuda:0"
local N, K = 8 * 7168, 7168
local base = moe.randn({ N * K + 4 }, { seed = 3, dtype = "bf16", device = dev })
local q = moe.zeros({ N, K }, { dtype = "e4m3", device = dev })
local s = moe.zeros({ N, K / 128 }, { dtype = "f32", device = dev })
local bytes = N * K * 3 + N * K / 128 * 4
for _, c in ipairs { { "whole blocks", base:view(0, { N, K }) }, { "general", base:view(2, { N, K }) } } do
  local ms = moe.bench(function() moe.quantize(c[2], { kind = "token", q = q, scale = s }) end,
    { warmup = 3, iters = 30, device = dev }).median_ms
  print(string.format("quantize %-12s %8.3f ms  %6.2f TB/s", c[1], ms, bytes / ms / 1e9))
end
