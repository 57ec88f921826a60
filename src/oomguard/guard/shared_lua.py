"""The Lua scripts of the capacity ledger that guard replicas share on one Redis.

Per backend ``B`` (keys hash-tagged ``{PREFIX:B}`` so that one backend's keys share a cluster
slot) the ledger splits the backend's usable KV blocks (``cap``) into parts that each have one
owner at a time::

    cap = free + ext + Σ over replicas (kept + offered)

* ``kept``: capacity a replica may fill without asking anyone (it admits against it locally,
  Redis or not);
* ``offered``: capacity a replica still owns but lets others take (it can withdraw only what
  is not taken yet; a replica that cannot reach Redis assumes all of it was taken);
* ``free``: owned by nobody (a new pool, a dead replica's untaken offers); negative while
  claims exceed it, a debt that offers repay first;
* ``ext``: claimed for KV that vLLM reports in use beyond every replica's own count (traffic
  that bypasses the guards, and the requests of a replica that died, until vLLM shows them
  gone).

Only a replica moves capacity out of its ``kept`` (into its ``offered``); capacity moves into a
replica's ``kept`` only inside these scripts. So a replica's own view of its ``kept`` is never
larger than the ledger's, whatever it missed, and ``Σ kept ≤ cap`` bounds what all replicas
admit together, with or without Redis (proof: tests/unit/guard/test_shared.py).

Keys: ``state`` (hash: ``cap``, ``bs``, ``eff``, ``obs`` blocks vLLM reported in use,
``snap_ms`` when polled, ``epoch``, ``free``, ``ext``, ``extd`` what the external claim still
lacks, ``exts`` recent estimates, ``settle_until``, ``lock_until``, ``clk``/``last_ms`` the
ledger's clock), ``members`` (hash: replica id → ``kept|offered|want|want_ms|seen|holding|
now_blocks|epoch``) and ``expect`` (set: replicas expected to claim their capacity back after
the state was lost).

Time is Redis's (``TIME``). A replica that has not synchronised for ``lease_ms`` of the
ledger's clock is gone: its offers return to ``free``, its ``kept`` to the external claim,
which keeps it until vLLM's own usage shows its requests gone. The ledger's clock counts a
gap between two calls as at most one second, so an outage of Redis itself expires nobody.
An empty state (first start, or Redis lost its data) gets a new ``epoch``; for ``settle_ms``,
and after a replica that knew the old epoch has come back until every replica it knew has
claimed its ``kept`` again (or ``lease_ms`` passed), nothing is granted from ``free``.
"""

from __future__ import annotations

_COMMON = r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(x) return string.format('%d', x) end

local function num(v, default)
  if v == false or v == nil or v == '' then return default end
  return tonumber(v)
end

local FIELDS = {'cap', 'snap_ms', 'epoch', 'free', 'ext', 'extd', 'exts', 'settle_until',
                'lock_until', 'clk', 'last_ms'}

-- The state of the ledger, created (a new epoch) when missing; the clock advanced.
local function load(S, now, settle)
  local v = redis.call('HMGET', S, unpack(FIELDS))
  local st = {cap = num(v[1], 0), snap_ms = num(v[2], nil), epoch = v[3], free = num(v[4], 0),
              ext = num(v[5], 0), extd = num(v[6], 0), exts = v[7] or '',
              settle_until = num(v[8], 0), lock_until = num(v[9], 0), clk = num(v[10], 0),
              last_ms = num(v[11], now)}
  if not st.epoch then
    st.epoch = fmt(now) .. '.' .. redis.call('TIME')[2]
    st.free = st.cap
    st.ext = 0; st.extd = 0; st.exts = ''
    st.settle_until = now + settle
    st.lock_until = 0
    st.clk = 0
    st.last_ms = now
  end
  st.clk = st.clk + math.min(math.max(now - st.last_ms, 0), 1000)
  st.last_ms = now
  return st
end

local function save(S, st)
  redis.call('HSET', S, 'cap', fmt(st.cap), 'epoch', st.epoch, 'free', fmt(st.free),
             'ext', fmt(st.ext), 'extd', fmt(st.extd), 'exts', st.exts,
             'settle_until', fmt(st.settle_until), 'lock_until', fmt(st.lock_until),
             'clk', fmt(st.clk), 'last_ms', fmt(st.last_ms))
end

local function read_members(M)
  local all = redis.call('HGETALL', M)
  local out = {}
  for i = 1, #all, 2 do
    local k, o, d, t, seen, h, n, ep = string.match(all[i + 1],
      '^(%-?%d+)|(%-?%d+)|(%-?%d+)|(%-?%d+)|(%-?%d+)|(%-?%d+)|(%-?%d+)|(.*)$')
    if k then
      out[all[i]] = {k = tonumber(k), o = tonumber(o), d = tonumber(d), t = tonumber(t),
                     seen = tonumber(seen), h = tonumber(h), n = tonumber(n), ep = ep}
    end
  end
  return out
end

local function write_members(M, members)
  for id, r in pairs(members) do
    redis.call('HSET', M, id, fmt(r.k) .. '|' .. fmt(r.o) .. '|' .. fmt(r.d) .. '|' .. fmt(r.t)
      .. '|' .. fmt(r.seen) .. '|' .. fmt(r.h) .. '|' .. fmt(r.n) .. '|' .. r.ep)
  end
end

-- Replicas silent for lease_ms of the ledger's clock are gone.
-- (What they kept is measured afresh: the estimates made while they counted are dropped.)
local function purge(M, st, members, lease)
  for id, r in pairs(members) do
    if st.clk - r.seen > lease then
      st.free = st.free + r.o
      st.ext = st.ext + r.k
      st.exts = ''
      redis.call('HDEL', M, id)
      members[id] = nil
    end
  end
end

-- Take up to `amount` blocks for `who` (nil: for the ledger itself): its own offer first, then
-- free (when allowed), then the other replicas' offers, largest first.
local function draw(st, members, who, amount, can_free)
  local got = 0
  if amount <= 0 then return 0 end
  if who ~= nil and members[who] ~= nil then
    local x = math.min(members[who].o, amount)
    members[who].o = members[who].o - x
    got = got + x
  end
  if can_free and got < amount and st.free > 0 then
    local x = math.min(st.free, amount - got)
    st.free = st.free - x
    got = got + x
  end
  if got < amount then
    local lenders = {}
    for id, r in pairs(members) do
      if id ~= who and r.o > 0 then lenders[#lenders + 1] = id end
    end
    table.sort(lenders, function(a, b) return members[a].o > members[b].o end)
    for _, id in ipairs(lenders) do
      if got >= amount then break end
      local x = math.min(members[id].o, amount - got)
      members[id].o = members[id].o - x
      got = got + x
    end
  end
  return got
end

-- Move what is on offer (and free, when allowed) to whoever waits: the debt of free first,
-- then the external claim, then the replicas' wants, oldest first.
local function distribute(st, members, can_free, fresh_ms)
  if st.free < 0 then
    st.free = st.free + draw(st, members, nil, -st.free, false)
  end
  if st.extd > 0 then
    local got = draw(st, members, nil, st.extd, can_free)
    st.ext = st.ext + got
    st.extd = st.extd - got
  end
  local waiting = {}
  for id, r in pairs(members) do
    if r.d > 0 and st.clk - r.seen <= fresh_ms then waiting[#waiting + 1] = id end
  end
  table.sort(waiting, function(a, b)
    if members[a].t == members[b].t then return a < b end
    return members[a].t < members[b].t
  end)
  for _, id in ipairs(waiting) do
    local r = members[id]
    local got = draw(st, members, id, r.d, can_free)
    r.k = r.k + got
    r.d = r.d - got
  end
end

local function locked(st, now, X)
  if now < st.settle_until then return true end
  if st.lock_until > 0 then
    if now < st.lock_until and redis.call('SCARD', X) > 0 then return true end
    st.lock_until = 0
    redis.call('DEL', X)
  end
  return false
end

local function stale(st, now, max_age)
  return st.snap_ms == nil or now - st.snap_ms > max_age
end
"""

# KEYS: state, members, expect
# ARGV: 1 replica id, 2 the epoch it knew ('' none), 3 its kept before this call (claimed when
#       the ledger does not know it), 4 give (kept → offered), 5 the kept blocks its queue
#       head needs (0: none; what it lacks is its want), 6 holding (projected peak of its requests),
#       7 blocks its requests hold now (with recent releases), 8 lease_ms, 9 settle_ms, 10 replicas
#       configured (0 none), 11 max_age_ms, 12 the replicas it knew (comma-separated)
# Returns {epoch, kept, offered, free, fair share, replicas, blocks older wants of others still
#          lack, the oldest such want's stamp, stale, locked, ext, members (comma-separated)}.
SYNC = (
    _COMMON
    + r"""
local S, M, X = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
local lease = tonumber(ARGV[8])
local now = now_ms()
local st = load(S, now, tonumber(ARGV[9]))
local members = read_members(M)
purge(M, st, members, lease)
local r = members[id]
if r == nil or r.ep ~= st.epoch then
  local claim = math.max(tonumber(ARGV[3]), 0)
  r = {k = claim, o = 0, d = 0, t = 0, seen = st.clk, h = 0, n = 0, ep = st.epoch}
  members[id] = r
  st.free = st.free - claim
  if ARGV[2] ~= '' and ARGV[2] ~= st.epoch then
    -- The state was lost while this replica held capacity: grant nothing from free until
    -- every replica it knew has claimed its own again, or a lease period passed.
    st.lock_until = math.max(st.lock_until, now + lease)
    for m in string.gmatch(ARGV[12], '[^,]+') do
      if m ~= id and members[m] == nil then redis.call('SADD', X, m) end
    end
  end
end
redis.call('SREM', X, id)
r.seen = st.clk
r.h = tonumber(ARGV[6])
r.n = tonumber(ARGV[7])
local give = math.min(math.max(tonumber(ARGV[4]), 0), r.k)
r.k = r.k - give
r.o = r.o + give
local target = tonumber(ARGV[5])
if target > r.k then
  if r.d == 0 then r.t = now end
  r.d = target - r.k
else
  r.d = 0
  r.t = 0
end
local is_stale = stale(st, now, tonumber(ARGV[11]))
local is_locked = locked(st, now, X)
local can_free = not is_stale and not is_locked
distribute(st, members, can_free, 1000)
local n = 0
local anyone_waits = st.extd > 0 or st.free < 0
for _, q in pairs(members) do
  n = n + 1
  if q.d > 0 then anyone_waits = true end
end
local fair = math.floor(st.cap / math.max(n, tonumber(ARGV[10]), 1))
if not anyone_waits and r.k < fair then
  r.k = r.k + draw(st, members, id, fair - r.k, can_free)
end
local older, oldest = st.extd, 0
if st.free < 0 then older = older - st.free end
for m, q in pairs(members) do
  if m ~= id and q.d > 0 and (r.d == 0 or q.t < r.t or (q.t == r.t and m < id)) then
    older = older + q.d
    if oldest == 0 or q.t < oldest then oldest = q.t end
  end
end
write_members(M, members)
save(S, st)
local ids = {}
for m, _ in pairs(members) do ids[#ids + 1] = m end
return {st.epoch, r.k, r.o, st.free, fair, n, older, oldest, is_stale and 1 or 0,
        is_locked and 1 or 0, st.ext, table.concat(ids, ',')}
"""
)

# KEYS: state, members, expect
# ARGV: 1 cap (usable blocks), 2 block size, 3 effective fraction, 4 blocks vLLM reports in
#       use (-1: unknown), 5 max_age_ms, 6 lease_ms, 7 settle_ms, 8 window_ms
# Records one poll of the backend: the pool (a change moves free), and the external claim,
# sized to the least excess of vLLM's usage over the replicas' own counts within window_ms
# (so that a replica's admissions not reported yet do not count). Returns {free, ext, extd}.
SNAPSHOT = (
    _COMMON
    + r"""
local S, M, X = KEYS[1], KEYS[2], KEYS[3]
local now = now_ms()
local st = load(S, now, tonumber(ARGV[7]))
local members = read_members(M)
purge(M, st, members, tonumber(ARGV[6]))
local cap = tonumber(ARGV[1])
if cap ~= st.cap then
  st.free = st.free + cap - st.cap
  st.cap = cap
end
st.snap_ms = now
redis.call('HSET', S, 'bs', ARGV[2], 'eff', ARGV[3], 'snap_ms', fmt(now))
local obs = tonumber(ARGV[4])
if obs >= 0 then
  redis.call('HSET', S, 'obs', ARGV[4])
  local ours = 0
  for _, q in pairs(members) do ours = ours + q.n end
  local est = math.max(obs - ours, 0)
  local window = tonumber(ARGV[8])
  local kept, lo, count = {}, est, 1
  for ms, e in string.gmatch(st.exts, '(%d+):(%d+)') do
    if now - tonumber(ms) <= window then
      kept[#kept + 1] = ms .. ':' .. e
      count = count + 1
      if tonumber(e) < lo then lo = tonumber(e) end
    end
  end
  kept[#kept + 1] = fmt(now) .. ':' .. fmt(est)
  while #kept > 32 do table.remove(kept, 1) end
  st.exts = table.concat(kept, ';')
  local target = lo
  if count < 3 then target = math.min(lo, st.ext + st.extd) end
  if target <= st.ext then
    st.free = st.free + st.ext - target
    st.ext = target
    st.extd = 0
  else
    st.extd = target - st.ext
  end
end
local can_free = not stale(st, now, tonumber(ARGV[5])) and not locked(st, now, X)
distribute(st, members, can_free, 1000)
write_members(M, members)
save(S, st)
return {st.free, st.ext, st.extd}
"""
)
