"""The Lua scripts that make admission atomic across guard replicas on one Redis.

Per backend ``B`` (keys hash-tagged ``{PREFIX:B}`` so that one backend's keys share a cluster
slot): ``leases`` (sorted set: lease id → expiry, Redis time in ms), ``data`` (hash: lease id →
``owner|stamp_ms|rate|full_blocks|fp;fp;…``, each ``fp`` = ``hi,final,remaining,sequences,growth``
with ``remaining`` −1 for no known end), ``state`` (hash: ``cap`` usable blocks, ``bs`` block
size, ``eff`` effective fraction, ``obs`` blocks vLLM reported in use, ``snap_ms`` when that
was polled, ``paused`` the latch, ``full`` the sum of the leases' full sizes) and ``released``
(list of ``ms:blocks`` of recent releases, for the poll that still shows them).

Every script reads the clock of Redis (``TIME``), so leases, envelopes and snapshots share
one clock whatever the replicas' clocks say. An envelope written at ``stamp_ms`` is aged by
its sequences' decode ``rate`` (tokens/s) when read: its ``hi`` grows, its end stays (both stay
upper bounds). The rule is the one of :mod:`oomguard.guard.admission`: the sum of the
footprints of unknown end (plus KV the backend reports beyond every lease) under ``high ×
eff × cap``; the projected peak under ``projected × eff × cap``; a refusal with the unknown sum
in the high band sets the latch until the projection falls below ``low``. A snapshot older
than ``max_age_ms`` counts as a full backend.
"""

from __future__ import annotations

_COMMON = r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function purge(leases, data, state, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  if #expired > 0 then
    for _, id in ipairs(expired) do
      local v = redis.call('HGET', data, id)
      if v then
        local full = tonumber(string.match(v, '^[^|]*|[^|]*|[^|]*|([^|]*)|'))
        redis.call('HINCRBY', state, 'full', -(full or 0))
      end
    end
    redis.call('ZREM', leases, unpack(expired))
    redis.call('HDEL', data, unpack(expired))
  end
  return #expired
end

local function blocks(tokens, bs)
  if tokens <= 0 then return 0 end
  return math.floor((tokens + bs - 1) / bs)
end

-- fps: list of {hi, final, rem (nil = no end), seq, growth}
local function parse_fps(text, aged_tokens, out, owner, owners)
  for hi, final, rem, seq, growth in string.gmatch(text, '(%-?%d+),(%-?%d+),(%-?%d+),(%d+),(%d+)') do
    hi = tonumber(hi); final = tonumber(final); rem = tonumber(rem)
    growth = tonumber(growth)
    if rem >= 0 then hi = math.min(hi + growth * aged_tokens, final) end
    if rem < 0 then rem = nil end
    local fp = {hi, final, rem, tonumber(seq), growth, owner}
    out[#out + 1] = fp
  end
end

local function read_leases(data, now)
  local fps = {}
  local all = redis.call('HGETALL', data)
  for i = 1, #all, 2 do
    local owner, stamp, rate, _, text = string.match(all[i + 1], '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
    local aged = math.ceil(tonumber(rate) * math.max(now - tonumber(stamp), 0) / 1000)
    parse_fps(text, aged, fps, owner)
  end
  return fps
end

local function at_step(fp, k, bs)
  if fp[3] ~= nil and k >= fp[3] then return 0 end
  return fp[4] * blocks(math.min(fp[1] + fp[5] * k, fp[2]), bs)
end

local function unknown_blocks(fps, bs)
  local total = 0
  for _, fp in ipairs(fps) do
    if fp[3] == nil then total = total + fp[4] * blocks(fp[2], bs) end
  end
  return total
end

local function peak_blocks(fps, bs)
  local peak = unknown_blocks(fps, bs)
  local steps = {}
  for _, fp in ipairs(fps) do
    if fp[3] ~= nil and fp[3] > 0 then steps[fp[3] - 1] = true end
  end
  for k, _ in pairs(steps) do
    local total = 0
    for _, fp in ipairs(fps) do total = total + at_step(fp, k, bs) end
    if total > peak then peak = total end
  end
  return peak
end

local function blocks_now(fps, bs)
  local total = 0
  for _, fp in ipairs(fps) do total = total + at_step(fp, 0, bs) end
  return total
end

local function recent_released(released, now, grace)
  local total = 0
  local items = redis.call('LRANGE', released, 0, -1)
  for _, item in ipairs(items) do
    local ms, b = string.match(item, '^(%d+):(%d+)$')
    if now - tonumber(ms) <= grace then total = total + tonumber(b) end
  end
  return total
end
"""

# KEYS: leases, data, state, released
# ARGV: lease_id, owner, lease_ms, full_blocks, new_fps, rate, high, low, projected,
#       max_age_ms, grace_ms
RESERVE = (
    _COMMON
    + r"""
local leases, data, state, released = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = now_ms()
purge(leases, data, state, now)
local st = redis.call('HMGET', state, 'cap', 'bs', 'eff', 'obs', 'snap_ms', 'paused', 'full')
if not st[1] or not st[5] then return {0, 'unknown', 0} end
if now - tonumber(st[5]) > tonumber(ARGV[10]) then return {0, 'stale', 0} end
local bs = tonumber(st[2])
local eff = math.floor(tonumber(st[1]) * tonumber(st[3]))
local high, low, proj = tonumber(ARGV[7]) * eff, tonumber(ARGV[8]) * eff, tonumber(ARGV[9]) * eff
local need = tonumber(ARGV[4])
local full = tonumber(st[7] or '0')
local obs = tonumber(st[4] or '0')

local function admit(margin)
  redis.call('ZADD', leases, now + tonumber(ARGV[3]), ARGV[1])
  redis.call('HSET', data, ARGV[1], ARGV[2] .. '|' .. now .. '|' .. ARGV[6] .. '|' .. need .. '|' .. ARGV[5])
  redis.call('HINCRBY', state, 'full', need)
  return {1, 'ok', margin}
end

-- The latch and the projection need every lease; the plain sums only counters.
local fps = nil
local ext = 0
local function load()
  fps = read_leases(data, now)
  ext = math.max(obs - blocks_now(fps, bs) - recent_released(released, now, tonumber(ARGV[11])), 0)
end

if st[6] == '1' then
  load()
  if peak_blocks(fps, bs) + ext < low then
    redis.call('HSET', state, 'paused', '0')
  else
    return {0, 'paused', 0}
  end
end
if full == 0 and obs < low then return admit(eff - need) end
if math.max(full, obs) + need <= high then return admit(eff - math.max(full, obs) - need) end
if fps == nil then load() end
local base_unknown = unknown_blocks(fps, bs) + ext
parse_fps(ARGV[5], 0, fps, ARGV[2])
local unknown = unknown_blocks(fps, bs) + ext
if unknown <= high then
  local peak = peak_blocks(fps, bs) + ext
  if peak <= proj then return admit(eff - peak) end
  return {0, 'projected', 0}
end
if base_unknown >= low then
  redis.call('HSET', state, 'paused', '1')
  redis.call('HINCRBY', state, 'pauses', 1)
end
return {0, 'full', 0}
"""
)

# KEYS: leases, data, state, released; ARGV: lease_id, now_blocks
RELEASE = (
    _COMMON
    + r"""
local now = now_ms()
local v = redis.call('HGET', KEYS[2], ARGV[1])
if v then
  local full = tonumber(string.match(v, '^[^|]*|[^|]*|[^|]*|([^|]*)|'))
  redis.call('HINCRBY', KEYS[3], 'full', -(full or 0))
  redis.call('HDEL', KEYS[2], ARGV[1])
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[4], now .. ':' .. ARGV[2])
redis.call('LTRIM', KEYS[4], 0, 255)
return v and 1 or 0
"""
)

# KEYS: leases, data, state; ARGV: owner, lease_ms, then (lease_id, rate, full, fps)…
# Rewrites the owner's envelopes and extends their leases; re-adds leases that expired or
# were lost while Redis was away.
RENEW = (
    _COMMON
    + r"""
local now = now_ms()
local n = 0
for i = 3, #ARGV, 4 do
  local id, rate, full, text = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  local old = redis.call('HGET', KEYS[2], id)
  if not old then redis.call('HINCRBY', KEYS[3], 'full', full) end
  if old then
    local was = tonumber(string.match(old, '^[^|]*|[^|]*|[^|]*|([^|]*)|'))
    if was ~= full then redis.call('HINCRBY', KEYS[3], 'full', full - (was or 0)) end
  end
  redis.call('HSET', KEYS[2], id, ARGV[1] .. '|' .. now .. '|' .. rate .. '|' .. full .. '|' .. text)
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
  n = n + 1
end
return n
"""
)

# KEYS: leases, data, state, released
# ARGV: cap, bs, eff, observed_blocks (−1: unknown), grace_ms, max_age_ms
# Records a poll of the backend; returns {paused, full, leases, per-owner peaks as
# owner, blocks pairs…} for /status and the static share.
SNAPSHOT = (
    _COMMON
    + r"""
local leases, data, state, released = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = now_ms()
purge(leases, data, state, now)
local bs = tonumber(ARGV[2])
redis.call('HSET', state, 'cap', ARGV[1], 'bs', ARGV[2], 'eff', ARGV[3], 'snap_ms', now)
if tonumber(ARGV[4]) >= 0 then redis.call('HSET', state, 'obs', ARGV[4]) end
local items = redis.call('LRANGE', released, 0, -1)
for i = #items, 1, -1 do
  local ms = tonumber(string.match(items[i], '^(%d+):'))
  if now - ms > tonumber(ARGV[5]) then redis.call('RPOP', released) else break end
end
local fps = read_leases(data, now)
local by_owner = {}
for _, fp in ipairs(fps) do
  local o = fp[6]
  if by_owner[o] == nil then by_owner[o] = {} end
  local list = by_owner[o]
  list[#list + 1] = fp
end
local out = {redis.call('HGET', state, 'paused') or '0', redis.call('HGET', state, 'full') or '0',
             redis.call('ZCARD', leases), peak_blocks(fps, bs)}
for owner, list in pairs(by_owner) do
  out[#out + 1] = owner
  out[#out + 1] = peak_blocks(list, bs)
end
return out
"""
)

# KEYS: replicas; ARGV: replica id, ttl_ms. Registers the replica (it has just republished
# its leases); returns {now_ms, id, expiry_ms, id, expiry_ms, …} of the live replicas.
HEARTBEAT = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local out = {now}
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #members do out[#out + 1] = members[i] end
return out
"""
