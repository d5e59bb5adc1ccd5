"""The Lua scripts of the Redis replica store (:mod:`kvsp.stores.redis`; spec §6.1 TTLs, §6.2
prefix lookup, §6.3 epochs), as Redis runs them (Lua 5.1).

Each script touches the keys of one scope only (``P:{S}:…``, one Redis Cluster slot): the
first key it is given names the slot, and the others it builds from the scope's key base. The
scripts that add and remove entries keep ``P:{S}:h``, each holder's number of entries in the
scope, in step with them. A key value is ``max expiry (15 digits)`` then entries of
``holder id (16 octets) ‖ expiry (15 digits) ‖ length (10 digits) ‖ record``.
"""

from __future__ import annotations

import hashlib

_ENTRIES = """
local EXP, HEAD = 15, 41
-- The entries of a key value: {holder id, expiry, first octet, last octet}.
local function entries(v)
  local out, p = {}, EXP + 1
  while p <= #v do
    local last = p + HEAD - 1 + tonumber(string.sub(v, p + 16 + EXP, p + HEAD - 1))
    local expiry = tonumber(string.sub(v, p + 16, p + 15 + EXP))
    out[#out + 1] = {string.sub(v, p, p + 15), expiry, p, last}
    p = last + 1
  end
  return out
end
-- A key value made of the kept entries of v (and an extra entry); false when none is left.
local function rebuild(v, kept, extra, extra_expiry)
  local parts, top = {}, extra_expiry or 0
  for _, e in ipairs(kept) do
    parts[#parts + 1] = string.sub(v, e[3], e[4])
    if e[2] > top then top = e[2] end
  end
  parts[#parts + 1] = extra
  if #parts == 0 then return false end
  return string.format('%015d', top) .. table.concat(parts)
end
-- Write the key value of key k in hash r, or remove the key when nothing is left.
local function store(r, k, v)
  if v then redis.call('HSET', r, k, v) else redis.call('HDEL', r, k) end
end
-- One entry of a holder fewer in the per-holder counts h of a scope.
local function uncount(h, holder)
  if redis.call('HINCRBY', h, holder, -1) <= 0 then redis.call('HDEL', h, holder) end
end
"""

# KEYS: r, x, c, h. ARGV: compat hex, the allowances (holder id ‖ 15 digits each: how many
# entries the holder may have in this scope; a holder not listed has no bound), then (block key,
# holder id, expiry digits, record) per record. Returns the 0-based positions of the records
# refused: new entries of a holder already at its allowance (a refresh is never refused).
PUT = (
    _ENTRIES
    + """
redis.call('SADD', KEYS[3], ARGV[1])
local allow, refused = {}, {}
for p = 1, #ARGV[2], 16 + EXP do
  allow[string.sub(ARGV[2], p, p + 15)] = tonumber(string.sub(ARGV[2], p + 16, p + 15 + EXP))
end
for i = 3, #ARGV, 4 do
  local key, holder, expiry, record = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local old, kept, known = redis.call('HGET', KEYS[1], key), {}, false
  if old then
    for _, e in ipairs(entries(old)) do
      if e[1] ~= holder then kept[#kept + 1] = e else known = true end
    end
  end
  local cap = allow[holder]
  if not known and cap and tonumber(redis.call('HGET', KEYS[4], holder) or '0') >= cap then
    refused[#refused + 1] = (i - 3) / 4
  else
    if not known then redis.call('HINCRBY', KEYS[4], holder, 1) end
    local entry = holder .. expiry .. string.format('%010d', #record) .. record
    store(KEYS[1], key, rebuild(old, kept, entry, tonumber(expiry)))
    redis.call('ZADD', KEYS[2], expiry, key .. holder)
  end
end
return refused
"""
)

# KEYS: r, x, c, h. ARGV: compat hex, block key, holder id. Returns 1 when there was a record.
DELETE = (
    _ENTRIES
    + """
local old, kept, found = redis.call('HGET', KEYS[1], ARGV[2]), {}, 0
if old then
  for _, e in ipairs(entries(old)) do
    if e[1] == ARGV[3] then found = 1 else kept[#kept + 1] = e end
  end
  if found == 1 then
    store(KEYS[1], ARGV[2], rebuild(old, kept))
    uncount(KEYS[4], ARGV[3])
  end
end
redis.call('ZREM', KEYS[2], ARGV[2] .. ARGV[3])
if redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ARGV[1])
end
return found
"""
)

# KEYS: r. ARGV: now, the block keys (32 octets each, concatenated). Returns the key values of
# the leading keys whose largest expiry is after now (§6.2: stop at the first without one).
LOOKUP = """
local now, blob = tonumber(ARGV[1]), ARGV[2]
local n, i, chunk, out = #blob / 32, 0, 8, {}
while i < n do
  local last, fields = math.min(n, i + chunk), {}
  for j = i, last - 1 do fields[#fields + 1] = string.sub(blob, 32 * j + 1, 32 * j + 32) end
  local values = redis.call('HMGET', KEYS[1], unpack(fields))
  for j = 1, #values do
    local v = values[j]
    if not v or tonumber(string.sub(v, 1, 15)) <= now then return out end
    out[#out + 1] = v
  end
  i, chunk = last, math.min(chunk * 2, 512)
end
return out
"""

# KEYS: c. ARGV: the scope's key base ("P:{S}:"), now, budget. Removes due records, earliest
# first; returns {records removed, compat ids left in the scope}.
SWEEP = (
    _ENTRIES
    + """
local now, budget, removed = tonumber(ARGV[2]), tonumber(ARGV[3]), 0
local h = ARGV[1] .. 'h'
for _, compat in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if budget <= 0 then break end
  local r, x = ARGV[1] .. 'r:' .. compat, ARGV[1] .. 'x:' .. compat
  local due = redis.call('ZRANGEBYSCORE', x, '-inf', now, 'LIMIT', 0, budget)
  for _, member in ipairs(due) do
    local key, holder = string.sub(member, 1, 32), string.sub(member, 33, 48)
    local old, kept = redis.call('HGET', r, key), {}
    if old then
      for _, e in ipairs(entries(old)) do
        if e[1] ~= holder or e[2] > now then kept[#kept + 1] = e else uncount(h, holder) end
      end
      store(r, key, rebuild(old, kept))
    end
  end
  if #due > 0 then redis.call('ZREM', x, unpack(due)) end
  removed, budget = removed + #due, budget - #due
  if redis.call('ZCARD', x) == 0 then
    redis.call('DEL', r)
    redis.call('SREM', KEYS[1], compat)
  end
end
return {removed, redis.call('SCARD', KEYS[1])}
"""
)

# KEYS: c. ARGV: key base, block key, now. The compat ids (hex) with a live record of the key.
COMPATS_WITH_KEY = """
local out = {}
for _, compat in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local v = redis.call('HGET', ARGV[1] .. 'r:' .. compat, ARGV[2])
  if v and tonumber(string.sub(v, 1, 15)) > tonumber(ARGV[3]) then out[#out + 1] = compat end
end
return out
"""

# KEYS: c. ARGV: key base, now. The compat ids (hex) with any live record in the scope.
COMPATS_IN_SCOPE = """
local out = {}
for _, compat in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('ZCOUNT', ARGV[1] .. 'x:' .. compat, '(' .. ARGV[2], '+inf') > 0 then
    out[#out + 1] = compat
  end
end
return out
"""

# KEYS: c. ARGV: key base. How many records the scope holds (expired ones not swept included).
COUNT = """
local total = 0
for _, compat in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  total = total + redis.call('ZCARD', ARGV[1] .. 'x:' .. compat)
end
return total
"""

# KEYS: status hash. ARGV: epoch (decimal), expiry, record JSON, poisoned-above bound (decimal,
# or empty for none). 0 when the epoch is lower than the highest seen (§6.3) and that one is not
# above the bound (kvsp.lifecycle: a poisoned epoch); decimal strings compare by length first,
# so any uint64 is exact.
PUT_STATUS = """
local function less(a, b) return #a < #b or (#a == #b and a < b) end
local highest = redis.call('HGET', KEYS[1], 'epoch')
if highest and less(ARGV[1], highest) and (ARGV[4] == '' or not less(ARGV[4], highest)) then
  return 0
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'expires', ARGV[2], 'record', ARGV[3])
return 1
"""


class Script:
    """A Lua script known by its SHA-1, so that calls send ``EVALSHA`` only."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


SCRIPTS = {
    name: Script(source)
    for name, source in (
        ("put", PUT),
        ("delete", DELETE),
        ("lookup", LOOKUP),
        ("sweep", SWEEP),
        ("compats_with_key", COMPATS_WITH_KEY),
        ("compats_in_scope", COMPATS_IN_SCOPE),
        ("count", COUNT),
        ("put_status", PUT_STATUS),
    )
}
LOOKUP_SHA = SCRIPTS["lookup"].sha
"""The SHA-1 of the lookup script, as ``EVALSHA`` names it (for tests counting commands)."""
