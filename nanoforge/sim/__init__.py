"""The cluster simulator (`nanoforge simulate`): the conductor's routing and early rejection, and each instance's
scheduler and block manager, all the real code, driven by a discrete-event clock; only the model's forward
pass and the KV pool's transfers are replaced by time models measured on the real engine.

    profile.py     time models: step time from a SchedulerOutput, transfer time per block; profile JSON files
    profiles/      shipped profiles (`nanoforge simulate --profile NAME`)
    measure.py     `nanoforge simulate profile`: measure a profile on the real engine
    pool.py        the KV pool (LRU over chained block keys) and each instance's KV connector
    instance.py    one instance: the real Scheduler + BlockManager, stepped on modelled time
    cluster.py     the clock, the conductor (the real Router), a request's life; one simulation run
    report.py      goodput, percentiles, hit rates, utilisation: table, JSON, CDF plots
    capacity.py    the highest arrival-rate scale meeting the SLOs (bisection); the N:M sweep
    commands.py    the command line

`serve/` never imports this package.
"""
