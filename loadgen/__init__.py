"""The load generator behind `pagedserve bench` (client.py) and its fixed workloads
(workloads.py): shipped with the server, depending on nothing else of it."""
