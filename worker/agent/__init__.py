"""The worker agent (`python -m worker`): one per host, it joins the controller, follows its
assignment and supervises the trainers of the ranks it runs (docs/architecture.md, "Parts").

- agent.py: the loop (follow the assignment, supervise, publish progress)
- heartbeat.py: the heartbeat thread and the commit lease it gives
- launcher.py, zygote.py: trainer processes, forked from a zygote that imported torch once
- rank_process.py: one rank's trainer process (state and CPU use, collective counters)
- metrics_tail.py, rank_progress.py: its metrics file read as typed lines, folded into the
  rank's RankReport fields
- memory_watch.py: its peak memory and OOM-kill evidence
- metrics_endpoint.py: the agent's Prometheus endpoint
- probe.py: the health probe a quarantined worker passes to rejoin
- retry.py: riding out a Redis or controller outage (tenacity)
"""
