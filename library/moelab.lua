-- SPDX-License-Identifier: MIT
---@meta moelab
-- Type definitions of moelab's Lua API for the Lua language server (LuaLS): completion and type
-- hints in an editor.  Nothing here runs: the module is lua/moelab/init.lua and the C binding it
-- is made of.  An editor finds this file through .luarc.json (workspace.library); a project of
-- one's own adds this folder to its own workspace.library.  spec/annotations_spec.lua holds it to
-- the module as it runs and to docs/lua-api.md, name for name.

---@alias moe.dtype "f32"|"bf16"|"i32"|"e4m3"
---@alias moe.quant_kind "block"|"token"|"token_t"
---@alias moe.device string "cpu", "cuda" (cuda:0) or "cuda:N"
---@alias moe.scoring "softmax"|"sigmoid"|"sqrtsoftplus"
---@alias moe.layout "roundrobin"|"peer_major"

-- ---------------------------------------------------------------- tensors (the C binding's)

---A tensor: contiguous, row-major, up to 4 dimensions, on the CPU or a GPU.  Closing it (a
---`<close>` variable, or the collector) frees its memory; a view keeps its base alive.
---@class moe.Tensor
---@field shape integer[] its sizes
---@field dtype moe.dtype
---@field device string "cpu" or "cuda:N"
---@field closed boolean closed: unusable from now on
local Tensor = {}

---Nested tables of the values, shaped like the tensor.
---@return table
function Tensor:totable() end

---The values in one flat table, row-major.
---@return number[]
function Tensor:flat() end

---The value at a 1-based flat index.
---@param i integer
---@return number
function Tensor:get(i) end

---A copy on another device.
---@param device moe.device
---@return moe.Tensor
function Tensor:to(device) end

---Copies src's values in (the same dtype and element count, any devices); returns self.
---@param src moe.Tensor
---@return moe.Tensor
function Tensor:copy(src) end

---Sets every element to value, rounded to the dtype; returns self.
---@param value number
---@return moe.Tensor
function Tensor:fill(value) end

---Pseudo-normal values, the same bits on every device; returns self.
---@param seed integer
---@param std? number default 1
---@return moe.Tensor
function Tensor:randn(seed, std) end

---A view of the elements [offset, offset + prod(shape)) (offset 0-based), sharing the memory.
---@param offset integer
---@param shape integer[]
---@return moe.Tensor
function Tensor:view(offset, shape) end

---A view of the i-th (1-based) slice of the first dimension.
---@param i integer
---@return moe.Tensor
function Tensor:select(i) end

---@return integer
function Tensor:numel() end

---@return integer
function Tensor:nbytes() end

---The address of the first element (for comparing tensors, not for use).
---@return integer
function Tensor:address() end

---Whether the two tensors share a byte of memory.
---@param other moe.Tensor
---@return boolean
function Tensor:overlaps(other) end

---Frees the tensor now, as a `<close>` variable does at the end of its scope; unusable after.
function Tensor:close() end

---The address (an integer) of a new DLManagedTensor (versioned: DLManagedTensorVersioned) over the
---tensor's memory, kept alive until its consumer calls the deleter.
---@param o? { versioned?: boolean }
---@return integer
function Tensor:to_dlpack(o) end

---@class moe.TensorOptions
---@field dtype? moe.dtype default "f32"
---@field device? moe.device default "cpu"
---@field shape? integer[] the shape of a flat table of values

---@class moe.WrapOptions
---@field address integer|lightuserdata the first element, aligned to the dtype; moelab never frees it
---@field dtype moe.dtype
---@field shape integer[]
---@field device? moe.device default "cpu"
---@field keep? any held while the tensor, its views or a graph may use the memory

---@class moe.RandnOptions
---@field dtype? "f32"|"bf16" default "f32"
---@field device? moe.device default "cpu"
---@field seed? integer default 0
---@field std? number default 1

-- ---------------------------------------------------------------- events and graphs

---A timing event: a device event on a GPU, a monotonic clock on the CPU.
---@class moe.Event
local Event = {}

---Records the event on the current stream (the host's clock on the CPU).
function Event:record() end

---Milliseconds from start to this event (waits for this event).
---@param start moe.Event
---@return number
function Event:elapsed_since(start) end

---A CUDA graph of the stages a function issued (moe.graph).
---@class moe.Graph
local Graph = {}

---Reruns the captured stages on whatever their tensors hold now.
function Graph:replay() end

---@class moe.GraphOptions
---@field device? moe.device the GPU to capture on (default the default device)

-- ---------------------------------------------------------------- the stages' options

---@class moe.RouteOptions
---@field logits moe.Tensor f32 [N, E]
---@field k integer experts per token
---@field scoring? moe.scoring default "softmax"
---@field bias? moe.Tensor f32 [E] selection bias (sigmoid, sqrtsoftplus)
---@field groups? integer expert groups (sigmoid), default 1
---@field topk_groups? integer groups kept
---@field scale? number routed scaling factor (sigmoid, sqrtsoftplus)
---@field nan? "error"|"mask" rows that cannot be scored: raise (default) or route nowhere
---@field ids? moe.Tensor i32 [N, K] output buffer
---@field weights? moe.Tensor f32 [N, K] output buffer

---@class moe.RouteInfo
---@field nan_rows integer rows that could not be scored

---@class moe.ScheduleOptions
---@field ids moe.Tensor i32 [W, T, K], every rank's routing
---@field experts integer E, a multiple of W
---@field rank? integer 0-based, default 0
---@field pad? integer rows of an expert padded to a multiple of this, default 1
---@field capacity? integer|"worst"|"twice_mean" rows, or a policy (moe.schedule: "worst")
---@field expert_capacity? integer routes kept per expert before padding
---@field layout? moe.layout default "roundrobin"
---@field overflow? "error"|"drop"
---@field invalid? "error"|"skip"

---@class moe.DispatchOptions
---@field x moe.Tensor bf16 or e4m3 [W, T, H]
---@field schedule moe.Schedule
---@field k? integer the schedule's top-k
---@field zero_fill? boolean rows without a route zeroed (and their scales, for e4m3)
---@field out? moe.Tensor bf16 or e4m3 (x's) [C, H]
---@field x_scale? moe.Tensor f32 [W, T, H/128], x's scales: required with an e4m3 x
---@field out_scale? moe.Tensor f32 [H/128, C], the rows' scales transposed (e4m3 x only)

---@class moe.QuantizeOptions
---@field kind moe.quant_kind "block": 128 x 128 blocks; "token": 1 x 128; "token_t": 1 x 128, scales transposed
---@field q? moe.Tensor e4m3 of x's shape
---@field scale? moe.Tensor f32, one per block

---@class moe.DequantizeOptions
---@field kind moe.quant_kind as the scales were made
---@field dtype? "f32"|"bf16" default "f32"
---@field out? moe.Tensor f32 or bf16 of q's shape

---@class moe.ExpertsOptions
---@field x moe.Tensor bf16 [C, H], or e4m3 (FP8 experts: H and F multiples of 128)
---@field offsets moe.Tensor i32 [EL + 1], the schedule's expert_offsets
---@field w_gate_up moe.Tensor bf16 [EL, 2F, H], e4m3 with an e4m3 x
---@field w_down moe.Tensor bf16 [EL, H, F], e4m3 with an e4m3 x
---@field x_scale? moe.Tensor f32 [H/128, C] ("token_t" scales), with an e4m3 x only
---@field w_gate_up_scale? moe.Tensor f32 [EL, 2F/128, H/128] ("block" scales), with an e4m3 x only
---@field w_down_scale? moe.Tensor f32 [EL, H/128, F/128], with an e4m3 x only
---@field out? moe.Tensor bf16 [C, H], or x itself (bf16 x only)

---@class moe.CombineOptions
---@field schedule? moe.Schedule a world of one rank
---@field schedules? moe.Schedule[] one per rank
---@field y? moe.Tensor a world of one rank's expert outputs
---@field ys? moe.Tensor[] one per rank
---@field weights moe.Tensor f32 [T, K] of the source rank
---@field rank? integer the source rank, default 0
---@field out? moe.Tensor bf16 or f32 [T, H]
---@field shared? moe.Tensor bf16 [T, H] shared-expert output
---@field shared_gate? moe.Tensor f32 [T] its multiplier
---@field dtype? "bf16"|"f32"

---@class moe.ScheduleStats
---@field rows_needed integer padded rows the routes would need without capacity
---@field rows_used integer
---@field dropped integer routes that got no row
---@field invalid integer ids outside [0, E) other than -1
---@field first_invalid integer flat index of the first, or -1

---A rank's schedule: its buffers, made once (moe.schedule_plan), rerun in place.
---@class moe.Schedule
---@field peer_rank moe.Tensor i32 [C]
---@field peer_route moe.Tensor i32 [C]
---@field counts moe.Tensor i32 [EL]
---@field tokens_per_expert moe.Tensor i32 [EL]
---@field expert_offsets moe.Tensor i32 [EL + 1]
---@field route_row moe.Tensor i32 [W, T*K]
---@field capacity integer
---@field rank integer
---@field world integer
local Schedule = {}

---Runs the scheduler into the plan's buffers; reads nothing back (capturable).
---@return moe.Schedule
function Schedule:run() end

---Which kernel run() issues and why; runs nothing.
---@return moe.Choice
function Schedule:explain() end

---@return moe.ScheduleStats
function Schedule:read_stats() end

---Raises on what the schedule's policies do not allow (overflow, invalid ids).
---@return moe.Schedule
function Schedule:check() end

---Which kernel a stage runs and why; prints as the library's report.
---@class moe.Choice
---@field kernel string
---@field candidates { name: string, verdict: string }[]

---@class moe.KernelOptions
---@field schedule_kernel? string "auto" or a kernel's name
---@field experts_kernel? string
---@field experts_fp8_kernel? string

-- ---------------------------------------------------------------- checks and timing

---@class moe.CloseOptions
---@field rtol? number default 2e-2
---@field atol? number default 0
---@field l2? number relative L2, default 1e-2
---@field what? string names the values in the message

---@class moe.Metrics
---@field n integer values compared
---@field max_abs number max |got - ref|
---@field max_ref number max |ref|
---@field rel_max number their ratio
---@field rel_l2 number relative L2 error
---@field nans integer
---@field infs integer infinities that differ
---@field worst integer the 1-based flat index of the largest error
---@field shape? integer[]
---@field rtol? number (a layer's check with raise = false: its tolerances and verdict)
---@field l2? number
---@field pass? boolean

---@class moe.Check
local Check = {}

---Raises with a diff unless got is within the tolerances of ref.
---@param got moe.Tensor|number[]
---@param ref moe.Tensor|number[]
---@param opts? moe.CloseOptions
function Check.close(got, ref, opts) end

---Raises unless a and b hold exactly the same values (and shapes).
---@param a moe.Tensor|number[]
---@param b moe.Tensor|number[]
---@param what? string
function Check.equal(a, b, what) end

---@param got moe.Tensor|number[]
---@param ref moe.Tensor|number[]
---@return moe.Metrics
function Check.metrics(got, ref) end

---A layer's check: the metrics and .pass with o.raise = false, else Check.close.
---@param got moe.Tensor|number[]
---@param ref moe.Tensor|number[]
---@param o? { rtol?: number, l2?: number, raise?: boolean }
---@param what? string
---@return moe.Metrics
function Check.verdict(got, ref, o, what) end

---@class moe.BenchOptions
---@field warmup? integer default 3
---@field iters? integer default 10
---@field device? moe.device whose clock (default the default device)

---@class moe.BenchResult
---@field median_ms number
---@field min_ms number
---@field max_ms number
---@field mean_ms number
---@field iters integer
---@field times_ms number[]

---What a device is (moe.device_info).
---@class moe.DeviceInfo
---@field kind "cpu"|"cuda"
---@field name string the GPU's name, or the CPU's model
---@field threads? integer the CPU backend's threads
---@field sm_count? integer
---@field sm_clock_mhz? integer the peak SM clock
---@field memory_mib? integer
---@field compute_capability? string "9.0"
---@field driver? string the driver's CUDA version, "12.8"
---@field runtime? string the CUDA runtime's version
---@field nccl? string the NCCL linked in, in a build with NCCL
---@field device? string the device it describes (in a report's run metadata)

-- ---------------------------------------------------------------- models and layers

---A model preset (moe.models) or a table of the same fields.
---@class moe.Model
---@field name string
---@field experts integer
---@field k integer
---@field hidden integer
---@field ffn integer
---@field shared_ffn? integer
---@field shared_gate? boolean
---@field scoring? moe.scoring
---@field groups? integer
---@field topk_groups? integer
---@field scale? number

---@class moe.Models
---@field kimi_k2 moe.Model
---@field deepseek_v3 moe.Model
---@field deepseek_v4_pro moe.Model
---@field glm5 moe.Model
---@field qwen3_235b moe.Model
---@field qwen3_5_397b moe.Model

---@class moe.LayerOptions
---@field model moe.Model|string a preset or its name
---@field tokens integer per rank
---@field world? integer|moe.World ranks simulated on one device (default 1), or a real world
---@field hidden? integer
---@field ffn? integer
---@field experts? integer
---@field k? integer
---@field shared_ffn? integer
---@field shared_gate? boolean
---@field shared? boolean
---@field scoring? moe.scoring
---@field groups? integer
---@field topk_groups? integer
---@field scale? number
---@field pad? integer
---@field layout? moe.layout
---@field capacity? integer|"worst"|"twice_mean"
---@field expert_capacity? integer
---@field overflow? "error"|"drop"
---@field invalid? "error"|"skip"
---@field nan? "error"|"mask"
---@field device? moe.device
---@field seed? integer of the weights
---@field memory_limit? number bytes the layer may take (default: what the device has free)
---@field checkpoint? string a Hugging Face checkpoint whose MoE layer `layer` gives the weights
---@field layer? integer that layer's N (model.layers.N)
---@field precision? "bf16"|"fp8" the experts' (default "bf16"); fp8: e4m3 weights and tokens, simulated worlds

---@class moe.ForwardOptions
---@field logits? moe.Tensor|moe.Tensor[] routing given as logits
---@field ids? moe.Tensor|moe.Tensor[] routing given as ids (with weights)
---@field weights? moe.Tensor|moe.Tensor[]
---@field check? boolean false: nothing read back (left to layer:check)
---@field trace? boolean record the spans layer:trace() returns

---@class moe.LayerCheckOptions
---@field sample? integer tokens of each rank checked
---@field rtol? number
---@field l2? number
---@field raise? boolean false: the metrics with .pass instead of an error

---@class moe.ReferenceOptions
---@field logits? moe.Tensor
---@field ids? moe.Tensor
---@field weights? moe.Tensor
---@field routing? "own"|"forward"
---@field tokens? integer[] 0-based token indices
---@field sample? integer (a real world)

---@class moe.LayerStats
---@field ranks { rank: integer, rows_used: integer, rows_needed: integer, dropped: integer, routes: integer }[]
---@field loads integer[] routes per expert, every held rank's experts in order
---@field rows_used integer
---@field rows_needed integer
---@field routes integer
---@field dropped integer
---@field invalid integer
---@field unscored integer
---@field max_load integer
---@field mean_load number
---@field padding integer
---@field padding_waste number

---A stage of a traced forward on one rank (layer:trace).
---@class moe.Span
---@field stage string
---@field rank integer
---@field start_ms number since the forward began on the rank's device
---@field dur_ms number
---@field device string
---@field all_ranks boolean one call made this stage for every rank (the span is that call's)

---The kernels a rank's stages would run (layer:plan).
---@class moe.RankPlan
---@field rank integer
---@field schedule moe.Choice
---@field experts moe.Choice
---@field shared? moe.Choice

---The memory a layer takes, stated before anything is allocated (moe.layer_memory, layer.memory).
---@class moe.LayerMemory
---@field host number bytes on the host
---@field device number bytes on the device (the largest of a world's GPUs)
---@field weights number
---@field buffers number
---@field reference_host? number the CPU reference's copies of a GPU layer's weights

---An MoE layer over a world of expert-parallel ranks (moe.layer).
---@class moe.Layer
---@field world integer ranks
---@field tokens integer per rank
---@field experts integer
---@field k integer
---@field hidden integer
---@field ffn integer
---@field capacity integer rows per rank
---@field pad integer
---@field layout moe.layout
---@field device string
---@field input? moe.Tensor the buffer a capture runs on (a simulated world)
---@field inputs? moe.Tensor[] each local rank's exchange window (a real world)
---@field memory moe.LayerMemory what it takes
local Layer = {}

---@param o moe.LayerOptions
---@return moe.Layer
function Layer.new(o) end

---The memory a layer of these options would take; nothing is allocated.
---@param o moe.LayerOptions
---@return moe.LayerMemory
function Layer.memory_of(o) end

---One forward pass: out, a view of the layer's buffer (one per local rank in a real world).
---@param x moe.Tensor|moe.Tensor[]
---@param o? moe.ForwardOptions
---@return moe.Tensor|moe.Tensor[]
function Layer:forward(x, o) end

---The dense f32 reference on the CPU.
---@param x moe.Tensor|moe.Tensor[]
---@param o? moe.ReferenceOptions
---@return moe.Tensor|moe.Tensor[]
function Layer:reference(x, o) end

---The last forward against the reference: raises out of tolerance unless o.raise = false.
---@param x moe.Tensor|moe.Tensor[]
---@param o? moe.LayerCheckOptions
---@return moe.Metrics
function Layer:check(x, o) end

---@return moe.LayerStats
function Layer:stats() end

---Milliseconds per stage of the last eager forward, its slowest device's.
---@return table<string, number>
function Layer:stage_times() end

---The last forward's stages as spans, one per stage and rank; it must have had trace = true.
---@return moe.Span[]
function Layer:trace() end

---Which kernel each stage runs on each held rank, and why (nothing runs).
---@param x? moe.Tensor|moe.Tensor[]
---@return moe.RankPlan[]
function Layer:plan(x) end

---The whole forward pass as one CUDA graph over x (default layer.input / layer.inputs).
---@param x? moe.Tensor|moe.Tensor[]
---@return moe.LayerGraph
function Layer:capture(x) end

---@class moe.LayerGraph
local LayerGraph = {}

---Reruns the pass on x's current contents; a view of the output.
---@return moe.Tensor
function LayerGraph:replay() end

---Raises what the layer's policies do not allow in the last replay.
---@return moe.LayerGraph
function LayerGraph:check() end

-- ---------------------------------------------------------------- worlds across GPUs

---@class moe.WorldOptions
---@field devices? integer[] every rank in this process, one per GPU
---@field rank? integer one rank of a multi-process launch
---@field size? integer
---@field device? integer its GPU
---@field id? string the NCCL unique id, hex
---@field id_file? string a file holding it
---@field id_wait? number seconds to wait for the file
---@field from_env? boolean MOE_RANK, MOE_WORLD_SIZE, MOE_DEVICE, MOE_NCCL_ID(_FILE)
---@field comm? integer|lightuserdata the address of a caller's ncclComm_t (with device)

---This process's part of a world of expert-parallel ranks over NCCL (docs/multi-gpu.md).
---@class moe.World
---@field size integer W
---@field ranks integer[] the ranks this process holds
---@field devices string[] their GPUs
---@field local_count integer
---@field rank integer the first local rank
---@field device string its GPU
local World = {}

function World:close() end

---Points the module at local rank i's stream (default 1).
---@param i? integer
---@return moe.World
function World:bind(i) end

---@return moe.World
function World:unbind() end

---Every rank's ids: i32 [T, K] per local rank -> [W, T, K].
---@param ids moe.Tensor|moe.Tensor[]
---@param out? moe.Tensor|moe.Tensor[]
---@return moe.Tensor|moe.Tensor[]
function World:allgather_ids(ids, out) end

---Fails on every rank when the ranks' sizes differ.
---@param cfg table|table[] { tokens, k, experts, hidden, capacity, pad, layout, expert_capacity }
function World:check_config(cfg) end

---The all-gather exchange's dispatch.
---@param o table|table[] { x, schedule, out?, x_all? } per local rank
---@return moe.Tensor|moe.Tensor[]
function World:dispatch(o) end

---The all-gather exchange's dispatch of FP8 tokens: out e4m3 [C, H], out_scale f32 [H/128, C], x_all, x_scale_all.
---@param o table|table[] { x, x_scale, schedule, out?, out_scale?, x_all?, x_scale_all?, zero_fill? } per local rank
---@return moe.Tensor|moe.Tensor[]
function World:dispatch_fp8(o) end

---The all-gather exchange's combine.
---@param o table|table[] { schedule, y, weights, ids?, out?, shared?, shared_gate? } per local rank
---@return moe.Tensor|moe.Tensor[]
function World:combine(o) end

---The direct exchange over symmetric memory (collective).
---@param o { tokens: integer, k: integer, hidden: integer, capacity: integer }
---@return moe.Exchange
function World:exchange(o) end

---@class moe.Exchange
---@field x moe.Tensor[] each local rank's token window
---@field ys moe.Tensor[] each local rank's expert-output window
local Exchange = {}

---@param o table|table[] as World:dispatch
---@return moe.Tensor|moe.Tensor[]
function Exchange:dispatch(o) end

---@param o table|table[] as World:combine
---@return moe.Tensor|moe.Tensor[]
function Exchange:combine(o) end

-- ---------------------------------------------------------------- checkpoints

---One .safetensors file, its header checked whole (moe.safetensors).
---@class moe.SafeTensors
local SafeTensors = {}

---Every tensor name, sorted.
---@return string[]
function SafeTensors:names() end

---A tensor's { dtype, shape, offset, nbytes }, or nil.
---@param name string
---@return { dtype: string, shape: integer[], offset: integer, nbytes: integer }?
function SafeTensors:info(name) end

---Tensor name into dst (bf16 or f32, its shape, any device); scale: an F8_E4M3 tensor's block scale.
---@param name string
---@param dst moe.Tensor
---@param scale? moe.Tensor f32 on the CPU
function SafeTensors:read(name, dst, scale) end

---@return string
function SafeTensors:path() end

function SafeTensors:close() end

---A Hugging Face checkpoint of an MoE model (moe.checkpoint).
---@class moe.Checkpoint
---@field path string
local Checkpoint = {}

---The open reader of one of its files.
---@param path string
---@return moe.SafeTensors
function Checkpoint:file(path) end

---Closes its files; a later read opens them again.
function Checkpoint:close() end

---The reader holding tensor name and its info, or nothing.
---@param name string
---@return moe.SafeTensors?
---@return table? info
function Checkpoint:locate(name) end

---@return string[]
function Checkpoint:names() end

---Its MoE layers: the N of every model.layers.N.mlp.gate.weight, sorted.
---@return integer[]
function Checkpoint:layers() end

---Raises that layer n is not one of its MoE layers, listing those that are.
---@param n integer
---@param router string the router tensor's name
function Checkpoint:no_layer(n, router) end

---MoE layer n's { experts, hidden, ffn, shared_ffn, bias, dtype }.
---@param n integer
---@return { experts: integer, hidden: integer, ffn: integer, shared_ffn: integer, bias: boolean, dtype: string }
function Checkpoint:sizes(n) end

---A tensor's reader and info, checked: it exists, its dtype is readable, its shape is dims'.
---@param name string
---@param dims? table { {option, size}, ... }
---@return moe.SafeTensors
---@return table info
function Checkpoint:checked(name, dims) end

---Tensor name into dst (checked as checked() takes dims), FP8 dequantized.
---@param name string
---@param dims? table
---@param dst moe.Tensor
function Checkpoint:read_into(name, dims, dst) end

---The whole tensor, FP8 dequantized (bf16 by default), on device (default "cpu").
---@param name string
---@param o? { dtype?: "bf16"|"f32", device?: moe.device }
---@return moe.Tensor
function Checkpoint:tensor(name, o) end

-- ---------------------------------------------------------------- the module

---@class moelab
---@field version string moelab's version
---@field core table the C binding (moelab.core) the front-end is made of
---@field check moe.Check result checks that raise with a diff
---@field models moe.Models the model presets
---@field Layer moe.Layer the layer's class
---@field Schedule moe.Schedule the schedule's class
---@field World moe.World the world's class
---@field Exchange moe.Exchange the direct exchange's class
local moe = {}

---@param data table nested tables of numbers, or a flat table with opts.shape
---@param opts? moe.TensorOptions
---@return moe.Tensor
function moe.tensor(data, opts) end

---@param shape integer[]
---@param opts? moe.TensorOptions
---@return moe.Tensor
function moe.zeros(shape, opts) end

---@param shape integer[]
---@param value number
---@param opts? moe.TensorOptions
---@return moe.Tensor
function moe.full(shape, value, opts) end

---Pseudo-normal values, the same bits on every device.
---@param shape integer[]
---@param opts? moe.RandnOptions
---@return moe.Tensor
function moe.randn(shape, opts) end

---A tensor over memory the caller owns, without a copy.
---@param o moe.WrapOptions
---@return moe.Tensor
function moe.wrap(o) end

---A tensor that takes the DLPack managed tensor at address (its deleter called once, when done).
---@param address integer|lightuserdata
---@param o? { versioned?: boolean }
---@return moe.Tensor
function moe.from_dlpack(address, o) end

---The usable devices: "cpu", then "cuda:0", ...
---@return string[]
function moe.devices() end

---"cuda:0" where a GPU is usable, else "cpu".
---@return string
function moe.default_device() end

---What a device is: its name, clock, driver and CUDA versions (a GPU), model and threads (the CPU).
---@param device moe.device
---@return moe.DeviceInfo
function moe.device_info(device) end

---Opens an NVTX range of the caller's own (Nsight Systems, Nsight Compute), in the domain "moelab".
---@param name string
function moe.range_push(name) end

---Closes the innermost range moe.range_push opened on this thread.
function moe.range_pop() end

---Captures the stages fn issues on a GPU into a CUDA graph.
---@param fn fun()
---@param opts? moe.GraphOptions
---@return moe.Graph
function moe.graph(fn, opts) end

---A timing event on device (default the default device).
---@param device? moe.device
---@return moe.Event
function moe.event(device) end

---Stage 1: the top-k experts of each row of logits, and their weights.
---@param o moe.RouteOptions
---@return moe.Tensor ids i32 [N, K]
---@return moe.Tensor weights f32 [N, K]
---@return moe.RouteInfo info
function moe.route(o) end

---The routing options of o checked against E experts, with their defaults.
---@param fname string the function named in errors
---@param experts integer
---@param o table k, scoring, groups, topk_groups, scale
---@return moe.scoring scoring
---@return integer groups
---@return integer topk_groups
---@return number scale
function moe.routing_options(fname, experts, o) end

---Stage 2: a rank's schedule, run once.
---@param o moe.ScheduleOptions
---@return moe.Schedule
function moe.schedule(o) end

---A schedule's buffers, nothing run: s:run() later (inside a graph too).
---@param o moe.ScheduleOptions
---@return moe.Schedule
function moe.schedule_plan(o) end

---Stage 3: the rows of x the schedule placed on this rank.
---@param o moe.DispatchOptions
---@return moe.Tensor out bf16 or e4m3 [C, H]
---@return moe.Tensor? out_scale f32 [H/128, C], for an e4m3 x
function moe.dispatch(o) end

---Block-scaled e4m3 of x (f32 or bf16): q = e4m3(x / scale), one f32 scale per block.
---@param x moe.Tensor
---@param opts moe.QuantizeOptions
---@return moe.Tensor q
---@return moe.Tensor scale
function moe.quantize(x, opts) end

---e4m3(q) x scale, rounded to f32 or bf16.
---@param q moe.Tensor
---@param scale moe.Tensor
---@param opts moe.DequantizeOptions
---@return moe.Tensor
function moe.dequantize(q, scale, opts) end

---Stage 4: each expert's SwiGLU MLP over its rows.
---@param o moe.ExpertsOptions
---@return moe.Tensor bf16 [C, H]
function moe.experts(o) end

---Stage 5: each token's experts' outputs summed with its weights (plus the shared expert).
---@param o moe.CombineOptions
---@return moe.Tensor [T, H]
function moe.combine(o) end

---A whole layer from a preset, anything overridden.
---@param o moe.LayerOptions
---@return moe.Layer
function moe.layer(o) end

---The memory a layer of these options would take, before anything is allocated.
---@param o moe.LayerOptions
---@return moe.LayerMemory
function moe.layer_memory(o) end

---Times fn: warm-ups, then iters runs each timed with a pair of events.
---@param fn fun()
---@param opts? moe.BenchOptions
---@return moe.BenchResult
function moe.bench(fn, opts) end

---Which kernel a stage would run on these options, and why; nothing runs.
---@param stage "schedule"|"experts"
---@param o moe.ScheduleOptions|moe.ExpertsOptions
---@return moe.Choice
function moe.explain(stage, o) end

---The kernel options: sets the ones given, returns them all.
---@param o? moe.KernelOptions
---@return moe.KernelOptions
function moe.config(o) end

---A Hugging Face checkpoint: a directory (model.safetensors.index.json or model.safetensors) or one
---.safetensors file.
---@param path string
---@return moe.Checkpoint
function moe.checkpoint(path) end

---One .safetensors file.
---@param path string
---@return moe.SafeTensors
function moe.safetensors(path) end

---This process's part of a world of ranks over NCCL.
---@param o moe.WorldOptions
---@return moe.World
function moe.world(o) end

---A new NCCL unique id, hex, for a multi-process world.
---@return string
function moe.world_unique_id() end

return moe
