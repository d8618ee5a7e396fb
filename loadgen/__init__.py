"""The load generator behind `pagedserve bench` (client.py), its fixed workloads
(workloads.py) and its command line (cli.py): shipped with the server, depending on
nothing else of it."""
