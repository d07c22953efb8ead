"""The Elastic Device Manager: processes join and leave a running job.

``records`` (signed requests and membership records), ``client`` (a trainer's view of the job's
store), ``server`` (the store process: admission and membership), ``world`` (building the next
world's process group in the background and installing it at a step boundary).
"""
