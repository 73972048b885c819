-- Settles one admitted request in every scope it was admitted in (the tenant's, and its key's
-- when limited): returns the unused part of its reservation (or charges the excess) to the
-- windows it was taken from, if they are still current, and frees its concurrency slot.
-- KEYS as in admit.lua (one triple per scope); ARGV: request id, tokens actually used.
-- Returns 1 when settled, 0 when there was nothing to settle (already settled or expired).
local id, used = ARGV[1], tonumber(ARGV[2])
local settled = 0
for i = 1, #KEYS / 3 do
  local win, inflight, res = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local r = redis.call('HGET', res, id)
  redis.call('ZREM', inflight, id)
  if r then
    if i == 1 then settled = 1 end
    redis.call('HDEL', res, id)
    local rt, rm, rd, rmo = string.match(r, '(%d+) (%d+) (%d+) (%d+)')
    local delta = used - tonumber(rt)
    for name, window in pairs({tpm = rm, day = rd, month = rmo}) do
      local w = redis.call('HGET', win, name .. '_w')
      if w == window then
        local v = tonumber(redis.call('HGET', win, name .. '_n') or '0') + delta
        if v < 0 then v = 0 end
        redis.call('HSET', win, name .. '_n', v)
      end
    end
  end
end
return settled
