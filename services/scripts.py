"""Lua scripts for the writes that must be atomic (see services/store.py).

Redis 7 replicates script effects, so TIME may be called before a write.

Scripts an agent runs (HEARTBEAT, CHECKPOINT_CAS) take the keys the agent may only read in
ARGV, not KEYS: Redis ACLs demand read *and* write permission on every key declared to
EVAL/EVALSHA, while a command inside the script is checked as what it is (an HMGET needs read
only). The agent's ACL user (services/store.py `agent_acl`) can then read, never write, its
assignment pointer and the job's hash. Keys in ARGV are invisible to Redis Cluster routing.
"""

# KEYS: workers:seen, worker:{wid}
# ARGV: wid, job, generation, worker:{wid}:assignment (read), the name of a job's assignment
#   with %s for the job id (read: `Keys.job_assignment("%s")`)
#   -> {server time, the pointer's job, that job's current generation}
# The answer is how an agent confirms its generation is still current (its commit lease).
# The pointer names the job and the worker's role only: a new generation that keeps the
# worker in the same role rewrites the job's assignment, not the pointers (issue 48).
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], 'beat', now, 'job', ARGV[2], 'generation', ARGV[3])
local job = redis.call('HGET', ARGV[4], 'job')
if not job then return {tostring(now), '', '0'} end
local gen = redis.call('HGET', string.format(ARGV[5], job), 'generation')
return {tostring(now), job, gen or '0'}
"""

# KEYS: worker:{wid}:progress, workers:reported   ARGV: wid, then the hash's field/value pairs
# An agent's report: the progress hash rewritten whole and the worker stamped in
# `workers:reported` with server time, in one step, so a reader that re-reads only what was
# stamped since its last read (services/progress.py) never misses a rewrite.
REPORT = """
local t = redis.call('TIME')
redis.call('DEL', KEYS[1])
if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end
redis.call('ZADD', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[1])
return 1
"""

# KEYS: jobs:seq, job:{jid}, jobs, jobs:open   ARGV: jid, then the record's field/value pairs
#   -> the job's sequence number (its place in the queue)
# One script, so a replicated write (services/store.py `_durable`) covers all of it.
CREATE_JOB = """
local seq = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], 'seq', seq, unpack(ARGV, 2))
redis.call('ZADD', KEYS[3], seq, ARGV[1])
redis.call('ZADD', KEYS[4], seq, ARGV[1])
return seq
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

# KEYS: lease, then every key the commands touch   ARGV: 'holder:token', JSON list of commands
# Runs the commands only while the caller still holds the lease (fencing token check), all or
# nothing. Redis does not roll a script back when a command fails midway, so everything that
# could fail is checked before the first write: the lease, each command's verb and arguments,
# that each key is declared in KEYS (the lease itself is not writable), and that each key
# holds the type its command needs, as the earlier commands will have left it. A failed check
# returns 'REFUSED command <n> (<verb> <key>): <why>' and writes nothing.
#   HSET key field value [field value ...]      DEL key [key ...]
#   HDEL key field [field ...]
#   DELIFEQ key field value: DEL key if HGET key field == value
#   ZREM key member [member ...]                PUBLISH channel message
#   ZADD key score member (one member; the score a number)
#   XADD key maxlen field value [...]: XADD key MAXLEN ~ maxlen * field value ...
# Answers the streams whose XADD failed (their events are lost; every other write landed).
FENCED_EXEC = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost')
end
local ok, cmds = pcall(cjson.decode, ARGV[2])
if not ok or type(cmds) ~= 'table' then
  return redis.error_reply('REFUSED command list: not a JSON array')
end
local NEEDS = {HSET = 'hash', HDEL = 'hash', DELIFEQ = 'hash', ZREM = 'zset', ZADD = 'zset', XADD = 'stream', DEL = 'any', PUBLISH = 'any'}
local function well_formed(c)
  local v, n = c[1], #c
  for i = 1, n do if type(c[i]) ~= 'string' then return false end end
  if v == 'HSET' then return n >= 4 and n % 2 == 0 end
  if v == 'XADD' then return n >= 5 and n % 2 == 1 and string.match(c[3], '^%d+$') ~= nil end
  if v == 'DELIFEQ' then return n == 4 end
  if v == 'ZADD' then return n == 4 and tonumber(c[3]) ~= nil end
  if v == 'PUBLISH' then return n == 3 end
  return n >= (v == 'DEL' and 2 or 3)  -- DEL key..., ZREM key member..., HDEL key field...
end
local function last_key(c)  -- keys are c[2] .. c[last_key(c)]
  if c[1] == 'PUBLISH' then return 1 end  -- a channel is not a key
  if c[1] == 'DEL' then return #c end
  return 2
end
local declared = {}
for i = 2, #KEYS do declared[KEYS[i]] = true end
declared[KEYS[1]] = nil
local kind = {}  -- key -> the type it will hold when the command being checked runs
local function refuse(n, c, why)
  return redis.error_reply('REFUSED command ' .. n .. ' (' .. tostring(c[1]) .. ' ' .. tostring(c[2]) .. '): ' .. why)
end
for n, c in ipairs(cmds) do
  if type(c) ~= 'table' then return refuse(n, {}, 'not a list') end
  local need = NEEDS[c[1]]
  if not need then return refuse(n, c, 'unknown verb; allowed: HSET HDEL DEL DELIFEQ ZREM ZADD XADD PUBLISH') end
  if not well_formed(c) then return refuse(n, c, 'wrong number or form of arguments') end
  for i = 2, last_key(c) do
    local k = c[i]
    if not declared[k] then
      return refuse(n, c, 'key ' .. k .. ' is not declared in KEYS (pass every key the commands touch)')
    end
    if need ~= 'any' then
      if kind[k] == nil then kind[k] = redis.call('TYPE', k)['ok'] end
      if kind[k] ~= 'none' and kind[k] ~= need then
        return refuse(n, c, 'key ' .. k .. ' holds a ' .. kind[k] .. ', ' .. c[1] .. ' needs a ' .. need)
      end
    end
    -- HSET and XADD create their type; DEL empties; DELIFEQ, HDEL and ZREM may empty a key, which
    -- is still fine for any later command on that key that this check lets through.
    if c[1] == 'DEL' then kind[k] = 'none' elseif c[1] == 'HSET' or c[1] == 'XADD' or c[1] == 'ZADD' then kind[k] = need end
  end
end
local unrecorded = {}
for _, c in ipairs(cmds) do
  if c[1] == 'DELIFEQ' then
    if redis.call('HGET', c[2], c[3]) == c[4] then redis.call('DEL', c[2]) end
  elseif c[1] == 'XADD' then
    -- The one write no check can foresee: a stream whose last id an agent set to the maximum
    -- refuses every '*'. An event lost is better than a transaction cut in half.
    local r = redis.pcall('XADD', c[2], 'MAXLEN', '~', c[3], '*', unpack(c, 4))
    if type(r) == 'table' and r.err then table.insert(unrecorded, c[2]) end
  else
    redis.call(unpack(c))
  end
end
return unrecorded
"""

# KEYS: job:{jid}:checkpoint
# ARGV: generation, step, path, keep, jid, job:{jid} (read), worker:{wid}:assignment (read)
#   -> false when refused, else a JSON list of the history entries that fell out of the
#      newest `keep` (the caller deletes exactly those directories, nothing else).
# Only the job's current generation may move the pointer, and only forward, except that a
# newer generation may restart from an older step (it restored a previous checkpoint); and
# only a worker whose own assignment pointer names that job (an agent's ACL user reads only
# its own pointer, so it cannot pass another worker's).
# `history` (newest first) is what restore may fall back to; all checks come before any write.
CHECKPOINT_CAS = """
local gen, step, keep = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
if tonumber(redis.call('HGET', ARGV[6], 'generation') or '-1') ~= gen then return false end
if redis.call('HGET', ARGV[7], 'job') ~= ARGV[5] then return false end
local cur_step = tonumber(redis.call('HGET', KEYS[1], 'step') or '-1')
local cur_gen = tonumber(redis.call('HGET', KEYS[1], 'generation') or '-1')
if gen == cur_gen and step <= cur_step then return false end
if gen < cur_gen then return false end
local history = cjson.decode(redis.call('HGET', KEYS[1], 'history') or '[]')
table.insert(history, 1, {step = step, generation = gen, path = ARGV[3]})
local dropped = {}
while #history > keep do table.insert(dropped, table.remove(history)) end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'step', ARGV[2], 'path', ARGV[3], 'generation', ARGV[1],
           'time', tonumber(t[1]) + tonumber(t[2]) / 1e6, 'history', cjson.encode(history))
if #dropped == 0 then return '[]' end
return cjson.encode(dropped)
"""
