"""The trainer service: one training group (rank actors driven by one Serve replica).

    (config)        trainer_service.*: services/common/config/trainer_service.py
    engines/        the TrainEngine contract (base.py) and backends: fsdp (FSDP2), megatron, mindspeed
    algos/          advantages, losses, off-policy corrections, DAPO filter (pure torch)
    core.py         the loop: FetchBatch -> advantages -> loss -> step -> publish -> checkpoint
    convert.py      TrajectoryGroups -> SequenceBatch
    group.py        TrainGroup protocol + LocalTrainGroup (one in-process engine)
    ranks.py        the rank actor (TrainWorker) and its spawn; light: no torch at import
    workers.py      RayTrainGroup (drives the ranks) + RankSender
    publisher.py    which publisher (services/weights) the trainer builds; RankZeroPublisher
    checkpoints.py  checkpoint directories (atomic, newest, rotation)
    factory.py      everything built from a MeshConfig
    servicer.py     TrainerService (GetTrainerStatus, SaveCheckpoint)
    deployment.py   the Serve shim (build_app)
"""
