"""Disaggregated serving, Mooncake's way: prefill and decode instances, a cluster-wide KV cache pool on
Mooncake Store, and a cache-aware conductor. The KV connector itself sits beside the block manager
(`serve/kv_connector.py`); what is here:

    mooncake_store.py   the pool: a KVPool over Mooncake Store's batched calls; `mooncake_master` on loopback
    instance.py         `nanoforge serve --role prefill|decode|both --store MASTER`: the hand-over endpoints
    handover.py         the hand-over protocol between the conductor and the instances
    router.py           routing policies, the online cost model, early rejection (no HTTP)
    conductor.py        `nanoforge conductor`: the cluster's OpenAI-compatible front door
    launcher.py         `nanoforge serve --disagg`: master, instances and conductor on one machine
    process.py          child processes that die with their parent
"""
