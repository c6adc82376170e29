"""Lua scripts for the writes that must be atomic (see services/store.py).

Redis 7 replicates script effects, so TIME may be called before a write.
"""

# KEYS: workers:seen, worker:{wid}   ARGV: wid, job, generation  ->  server time as a string
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], 'beat', now, 'job', ARGV[2], 'generation', ARGV[3])
return tostring(now)
"""

# KEYS: lease, token counter   ARGV: holder id, ttl ms  ->  'holder:token' or false
LEASE_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  if string.sub(cur, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return cur
  end
  return false
end
local v = ARGV[1] .. ':' .. redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], v, 'PX', ARGV[2])
return v
"""

# KEYS: lease   ARGV: 'holder:token'
LEASE_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lease   ARGV: 'holder:token', JSON list of commands.
# Runs every command only while the caller still holds the lease (fencing token check),
# all or nothing. DELIFEQ key field value: DEL key if HGET key field == value.
FENCED_EXEC = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost')
end
local cmds = cjson.decode(ARGV[2])
for _, c in ipairs(cmds) do
  if c[1] == 'DELIFEQ' then
    if redis.call('HGET', c[2], c[3]) == c[4] then redis.call('DEL', c[2]) end
  else
    redis.call(unpack(c))
  end
end
return #cmds
"""

# KEYS: job:{jid}, job:{jid}:checkpoint   ARGV: generation, step, path  ->  1 moved, 0 refused
# Only the job's current generation may move the pointer, and only forward, except that a
# newer generation may restart from an older step (it restored a previous checkpoint).
CHECKPOINT_CAS = """
local gen = tonumber(ARGV[1])
if tonumber(redis.call('HGET', KEYS[1], 'generation') or '-1') ~= gen then return 0 end
local cur_step = tonumber(redis.call('HGET', KEYS[2], 'step') or '-1')
local cur_gen = tonumber(redis.call('HGET', KEYS[2], 'generation') or '-1')
if gen == cur_gen and tonumber(ARGV[2]) <= cur_step then return 0 end
if gen < cur_gen then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[2], 'step', ARGV[2], 'path', ARGV[3], 'generation', ARGV[1],
           'time', tonumber(t[1]) + tonumber(t[2]) / 1e6)
return 1
"""
