-- Atomic admission for one tenant (all keys share the tenant's hash tag: Redis Cluster safe).
-- KEYS[1] windows HASH, KEYS[2] in-flight ZSET (member request id, score expiry ms),
-- KEYS[3] reservations HASH (request id -> "tokens minute day month").
-- ARGV: request id, tokens to reserve, rpm, tpm, daily, monthly, concurrency limits
-- (-1 = unlimited), reservation ttl ms, key ttl ms.
-- Returns {admitted, reason, retry_after_ms, rpm_limit, rpm_remaining, tpm_limit,
--          tpm_remaining, reset_requests_ms, reset_tokens_ms}.
local win, inflight, res = KEYS[1], KEYS[2], KEYS[3]
local id, tokens = ARGV[1], tonumber(ARGV[2])
local lim_rpm, lim_tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
local lim_day, lim_month, lim_conc = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local ttl, key_ttl = tonumber(ARGV[8]), tonumber(ARGV[9])

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

local function counter(name, window)
  local w = tonumber(redis.call('HGET', win, name .. '_w') or '-1')
  if w ~= window then return 0 end
  return tonumber(redis.call('HGET', win, name .. '_n') or '0')
end
local function add(name, window, n)
  local w = tonumber(redis.call('HGET', win, name .. '_w') or '-1')
  if w ~= window then
    if n < 0 then return end
    redis.call('HSET', win, name .. '_w', window, name .. '_n', n)
  else
    local v = tonumber(redis.call('HGET', win, name .. '_n') or '0') + n
    if v < 0 then v = 0 end
    redis.call('HSET', win, name .. '_n', v)
  end
end

-- Reservations of a gateway that died are returned when they expire.
local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now_ms)
for _, old in ipairs(expired) do
  local r = redis.call('HGET', res, old)
  if r then
    local rt, rm, rd, rmo = string.match(r, '(%d+) (%d+) (%d+) (%d+)')
    rt = tonumber(rt)
    if tonumber(rm) == minute then add('tpm', minute, -rt) end
    if tonumber(rd) == day then add('day', day, -rt) end
    if tonumber(rmo) == month then add('month', month, -rt) end
    redis.call('HDEL', res, old)
  end
  redis.call('ZREM', inflight, old)
end

local minute_reset = (minute + 1) * 60000 - now_ms
local rpm_used, tpm_used = counter('rpm', minute), counter('tpm', minute)
local function remaining(limit, used) if limit < 0 then return -1 end return math.max(limit - used, 0) end

-- The same request admitted twice (a retried admission call) holds one reservation.
if redis.call('HEXISTS', res, id) == 1 then
  return {1, 'duplicate', 0, lim_rpm, remaining(lim_rpm, rpm_used), lim_tpm, remaining(lim_tpm, tpm_used), minute_reset, minute_reset}
end

local function refuse(reason, retry)
  return {0, reason, retry, lim_rpm, remaining(lim_rpm, rpm_used), lim_tpm, remaining(lim_tpm, tpm_used), minute_reset, minute_reset}
end
if lim_conc >= 0 and redis.call('ZCARD', inflight) >= lim_conc then
  -- The earliest reservation expiry bounds the wait; requests usually finish sooner.
  return refuse('concurrency', 1000)
end
if lim_rpm >= 0 and rpm_used + 1 > lim_rpm then return refuse('rpm', minute_reset) end
if lim_tpm >= 0 and tpm_used + tokens > lim_tpm then
  if tokens > lim_tpm then return refuse('tpm_exceeds_limit', 0) end
  return refuse('tpm', minute_reset)
end
local day_used, month_used = counter('day', day), counter('month', month)
if lim_day >= 0 and day_used + tokens > lim_day then
  return refuse('daily_tokens', (day + 1) * 86400000 - now_ms)
end
if lim_month >= 0 and month_used + tokens > lim_month then
  return refuse('monthly_tokens', next_month_day * 86400000 - now_ms)
end

add('rpm', minute, 1)
add('tpm', minute, tokens)
add('day', day, tokens)
add('month', month, tokens)
redis.call('ZADD', inflight, now_ms + ttl, id)
redis.call('HSET', res, id, tokens .. ' ' .. minute .. ' ' .. day .. ' ' .. month)
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, key_ttl) end
return {1, 'admitted', 0, lim_rpm, remaining(lim_rpm, rpm_used + 1), lim_tpm, remaining(lim_tpm, tpm_used + tokens), minute_reset, minute_reset}
