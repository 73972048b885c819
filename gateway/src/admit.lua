-- Atomic admission for one tenant, and for its API key when the key has limits of its own.
-- Every key shares the tenant's hash tag: Redis Cluster safe.
-- KEYS: one triple per scope (the tenant's first, then the key's): windows HASH, in-flight
-- ZSET (member request id, score expiry ms), reservations HASH (request id ->
-- "tokens minute day month").
-- ARGV: request id, tokens to reserve, reservation ttl ms, key ttl ms, then per scope its rpm,
-- tpm, daily, monthly and concurrency limits (-1 = unlimited) and the tokens the ledger
-- already holds for it today and this month with the day and month they count (a day or month
-- window new to these counters starts from them when they are its own: a flushed Redis never
-- hands out a fresh month, and a figure read just before midnight never seeds the next day).
-- Returns {admitted, reason, retry_after_ms, refusing scope (1-based, 0 = none),
--          reset_ms, then per scope: rpm_limit, rpm_remaining, tpm_limit, tpm_remaining}.
local id, tokens = ARGV[1], tonumber(ARGV[2])
local ttl, key_ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local scopes = {}
for i = 1, #KEYS / 3 do
  local a = 4 + (i - 1) * 9
  scopes[i] = {win = KEYS[3 * i - 2], inflight = KEYS[3 * i - 1], res = KEYS[3 * i],
    rpm = tonumber(ARGV[a + 1]), tpm = tonumber(ARGV[a + 2]), day = tonumber(ARGV[a + 3]),
    month = tonumber(ARGV[a + 4]), conc = tonumber(ARGV[a + 5]),
    seed = {day = tonumber(ARGV[a + 6]), month = tonumber(ARGV[a + 7]),
      day_no = tonumber(ARGV[a + 8]), month_no = tonumber(ARGV[a + 9])}}
end

-- Redis's clock, so every gateway replica agrees on the windows.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sec = tonumber(t[1])
local minute = math.floor(sec / 60)
local day = math.floor(sec / 86400)
-- Civil month from days since the epoch (H. Hinnant's algorithm).
local z = day + 719468
local era = math.floor(z / 146097)
local doe = z - era * 146097
local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
local mp = math.floor((5 * doy + 2) / 153)
local m = mp < 10 and mp + 3 or mp - 9
local y = yoe + era * 400 + (m <= 2 and 1 or 0)
local month = y * 12 + (m - 1)
-- Milliseconds to the start of the next month (days in this month via the same algorithm).
local next_y, next_m = y, m + 1
if next_m == 13 then next_y, next_m = y + 1, 1 end
local ny = next_y - (next_m <= 2 and 1 or 0)
local nera = math.floor(ny / 400)
local nyoe = ny - nera * 400
local nmp = (next_m + 9) % 12
local ndoy = math.floor((153 * nmp + 2) / 5)
local ndoe = nyoe * 365 + math.floor(nyoe / 4) - math.floor(nyoe / 100) + ndoy
local next_month_day = nera * 146097 + ndoe - 719468

for _, s in ipairs(scopes) do
  if s.seed.day_no ~= day then s.seed.day = 0 end
  if s.seed.month_no ~= month then s.seed.month = 0 end
end

-- A window these counters have not seen yet starts at `seed` (0 for minutes).
local function counter(win, name, window, seed)
  local w = tonumber(redis.call('HGET', win, name .. '_w') or '-1')
  if w ~= window then return seed or 0 end
  return tonumber(redis.call('HGET', win, name .. '_n') or '0')
end
local function add(win, name, window, n, seed)
  local w = tonumber(redis.call('HGET', win, name .. '_w') or '-1')
  if w ~= window then
    if n < 0 then return end
    redis.call('HSET', win, name .. '_w', window, name .. '_n', (seed or 0) + n)
  else
    local v = tonumber(redis.call('HGET', win, name .. '_n') or '0') + n
    if v < 0 then v = 0 end
    redis.call('HSET', win, name .. '_n', v)
  end
end

local minute_reset = (minute + 1) * 60000 - now_ms
local function remaining(limit, used) if limit < 0 then return -1 end return math.max(limit - used, 0) end
for _, s in ipairs(scopes) do
  -- Reservations of a gateway that died are returned when they expire.
  local expired = redis.call('ZRANGEBYSCORE', s.inflight, '-inf', now_ms)
  for _, old in ipairs(expired) do
    local r = redis.call('HGET', s.res, old)
    if r then
      local rt, rm, rd, rmo = string.match(r, '(%d+) (%d+) (%d+) (%d+)')
      rt = tonumber(rt)
      if tonumber(rm) == minute then add(s.win, 'tpm', minute, -rt) end
      if tonumber(rd) == day then add(s.win, 'day', day, -rt) end
      if tonumber(rmo) == month then add(s.win, 'month', month, -rt) end
      redis.call('HDEL', s.res, old)
    end
    redis.call('ZREM', s.inflight, old)
  end
  s.rpm_used, s.tpm_used = counter(s.win, 'rpm', minute), counter(s.win, 'tpm', minute)
end

local function reply(admitted, reason, retry, refusing, extra_requests, extra_tokens)
  local out = {admitted, reason, retry, refusing, minute_reset}
  for _, s in ipairs(scopes) do
    table.insert(out, s.rpm)
    table.insert(out, remaining(s.rpm, s.rpm_used + extra_requests))
    table.insert(out, s.tpm)
    table.insert(out, remaining(s.tpm, s.tpm_used + extra_tokens))
  end
  return out
end

-- The same request admitted twice (a retried admission call) holds one reservation.
if redis.call('HEXISTS', scopes[1].res, id) == 1 then
  return reply(1, 'duplicate', 0, 0, 0, 0)
end

for i, s in ipairs(scopes) do
  local function refuse(reason, retry) return reply(0, reason, retry, i, 0, 0) end
  if s.conc >= 0 and redis.call('ZCARD', s.inflight) >= s.conc then
    -- The earliest reservation expiry bounds the wait; requests usually finish sooner.
    return refuse('concurrency', 1000)
  end
  if s.rpm >= 0 and s.rpm_used + 1 > s.rpm then return refuse('rpm', minute_reset) end
  if s.tpm >= 0 and s.tpm_used + tokens > s.tpm then
    if tokens > s.tpm then return refuse('tpm_exceeds_limit', 0) end
    return refuse('tpm', minute_reset)
  end
  local day_used = counter(s.win, 'day', day, s.seed.day)
  local month_used = counter(s.win, 'month', month, s.seed.month)
  if s.day >= 0 and day_used + tokens > s.day then
    return refuse('daily_tokens', (day + 1) * 86400000 - now_ms)
  end
  if s.month >= 0 and month_used + tokens > s.month then
    return refuse('monthly_tokens', next_month_day * 86400000 - now_ms)
  end
end

for _, s in ipairs(scopes) do
  add(s.win, 'rpm', minute, 1)
  add(s.win, 'tpm', minute, tokens)
  add(s.win, 'day', day, tokens, s.seed.day)
  add(s.win, 'month', month, tokens, s.seed.month)
  redis.call('ZADD', s.inflight, now_ms + ttl, id)
  redis.call('HSET', s.res, id, tokens .. ' ' .. minute .. ' ' .. day .. ' ' .. month)
end
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, key_ttl) end
return reply(1, 'admitted', 0, 0, 1, tokens)
