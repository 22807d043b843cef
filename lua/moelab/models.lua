-- SPDX-License-Identifier: MIT
-- Model presets: the MoE layer of each model as published (experts E, top-k K, hidden H,
-- expert FFN width F, shared experts, router scoring, groups, routed scaling factor).
--   shared_ffn: width of the shared-expert MLP (0 = none); shared_gate: Qwen-style sigmoid gate.
local models = {}

local function preset(t)
  t.groups = t.groups or 1
  t.topk_groups = t.topk_groups or t.groups
  t.scale = t.scale or 1.0
  t.shared_ffn = t.shared_ffn or 0
  t.shared_gate = t.shared_gate or false
  return t
end

models.kimi_k2 = preset { name = "Kimi K2", experts = 384, k = 8, hidden = 7168, ffn = 2048, shared_ffn = 2048,
  scoring = "sigmoid", scale = 2.827 }
models.deepseek_v3 = preset { name = "DeepSeek-V3", experts = 256, k = 8, hidden = 7168, ffn = 2048, shared_ffn = 2048,
  scoring = "sigmoid", groups = 8, topk_groups = 4, scale = 2.5 }
-- DeepSeek-V4-Pro: sqrt-softplus scoring, no groups; 384 experts, top-6, F = 3072.
models.deepseek_v4_pro = preset { name = "DeepSeek-V4-Pro", experts = 384, k = 6, hidden = 7168, ffn = 3072,
  shared_ffn = 3072, scoring = "sqrtsoftplus", scale = 2.5 }
models.glm5 = preset { name = "GLM-5", experts = 256, k = 8, hidden = 6144, ffn = 2048, shared_ffn = 2048,
  scoring = "sigmoid", scale = 2.5 }
models.qwen3_235b = preset { name = "Qwen3-235B-A22B", experts = 128, k = 8, hidden = 4096, ffn = 1536,
  scoring = "softmax" }
models.qwen3_5_397b = preset { name = "Qwen3.5-397B-A17B", experts = 512, k = 10, hidden = 4096, ffn = 1024,
  shared_ffn = 1024, shared_gate = true, scoring = "softmax" }

return models
