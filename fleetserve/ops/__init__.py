"""Operations tooling around a running platform: the RayService Helm chart and Kubernetes client
(``kube``), the GPU/MIG capacity planner and the chart values it emits (``planner``, ``gpus``,
``plan_report``), and the live status view (``status``). No Ray.
"""
