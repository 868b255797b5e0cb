{{/* Resource name: fullnameOverride or the release name, cut to 52 characters for KubeRay's suffixes. */}}
{{- define "fleetserve.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetserve.selectorLabels" -}}
app.kubernetes.io/name: fleetserve
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fleetserve.labels" -}}
{{ include "fleetserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "fleetserve.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "fleetserve.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{/* Ray Serve's config: one application built from the platform config by fleetserve's builder. */}}
{{/* Serve's applications: the front door (the ingress, on "/"), the metrics hub, and one per model. Serve's
     declarative API versions each application's deployments by its args, so a change to one model restarts that
     model's replicas alone (the front door restarts on any change; it holds no engine). Each gets only the server
     settings its deployments read. The hub's adapters are its user_config, which reaches a running hub without a
     restart. */}}
{{- define "fleetserve.serveConfig" -}}
{{- $server := .Values.platform.server | default dict -}}
proxy_location: {{ $server.proxy_location | default "EveryNode" }}
applications:
  - name: fleetserve
    import_path: fleetserve.deployments.builders:front_app_builder
    route_prefix: /
    args:
      platform:
        {{- toYaml .Values.platform | nindent 8 }}
  - name: fleetserve-hub
    import_path: fleetserve.deployments.builders:hub_app_builder
    route_prefix: null
    args:
      server: {{ pick $server "custom_resources" | toJson }}
    deployments:
      - name: metrics-hub
        user_config:
          adapters: {{ include "fleetserve.adapters" . }}
  {{- range .Values.platform.models }}
  - name: {{ printf "engine-%s" (replace "/" "--" .name) | quote }}
    import_path: fleetserve.deployments.builders:model_app_builder
    route_prefix: null
    args:
      server: {{ pick $server "serve_fast_path" "drain_timeout_s" | toJson }}
      model:
        {{- toYaml . | nindent 8 }}
  {{- end }}
{{- end -}}

{{/* The configured LoRA adapters, base model -> adapter name -> source, as JSON (the hub's registry): every
     model with lora, `lora: {}` included (a base left out would lose the adapters loaded at run time). */}}
{{- define "fleetserve.adapters" -}}
{{- $adapters := dict -}}
{{- range .Values.platform.models -}}
{{- if kindIs "map" .lora -}}
{{- $names := dict -}}
{{- range (.lora.adapters | default list) -}}
{{- $_ := set $names .name .source -}}
{{- end -}}
{{- $_ := set $adapters .name $names -}}
{{- end -}}
{{- end -}}
{{- toJson $adapters -}}
{{- end -}}

{{/* The GPU a worker group's pod asks Kubernetes for. Args: (dict "group" $group "root" $). */}}
{{- define "fleetserve.gpuLimits" -}}
{{- $strategy := .root.Values.gpu.migStrategy -}}
{{- if and .group.migProfile (gt (int (.group.numGpus | default 1)) 1) -}}
{{- fail "workerGroups: a group with a migProfile takes one slice per pod; numGpus above 1 needs whole GPUs (migProfile \"\")" -}}
{{- end -}}
{{- if and .group.migProfile (eq $strategy "mixed") -}}
nvidia.com/mig-{{ .group.migProfile }}: 1
{{- else -}}
nvidia.com/gpu: {{ .group.numGpus | default 1 }}
{{- end -}}
{{- end -}}

{{/* Node selector for a worker group: the GPU product (with the MIG profile under the single strategy). */}}
{{- define "fleetserve.gpuNodeSelector" -}}
{{- $strategy := .root.Values.gpu.migStrategy -}}
{{- if and .group.migProfile (eq $strategy "single") -}}
nvidia.com/gpu.product: {{ printf "%s-MIG-%s" .root.Values.gpu.product .group.migProfile }}
{{- else -}}
nvidia.com/gpu.product: {{ .root.Values.gpu.product }}
{{- end -}}
{{- with .group.nodeSelector }}
{{ toYaml . }}
{{- end -}}
{{- end -}}

{{/* rayStartParams for a worker group: its GPUs (one slice, or numGpus whole GPUs), plus a custom resource
     naming its MIG profile so engine replicas that ask for it (resources.custom_resources in the platform
     config) land here. */}}
{{- define "fleetserve.workerRayStartParams" -}}
num-gpus: {{ .group.numGpus | default 1 | toString | quote }}
{{- if .group.migProfile }}
resources: {{ printf "{\"mig-%s\": 1}" .group.migProfile | quote }}
{{- end -}}
{{- end -}}

{{- define "fleetserve.container" -}}
{{- $server := .Values.platform.server | default dict -}}
{{- $fastPath := and (hasKey $server "serve_fast_path") $server.serve_fast_path -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
env:
  {{- /* Serve's controller force-stops a replica that failed its health check, rather than draining requests a
       stalled engine never finishes (fleetserve.deployments.serve_options.CONTROLLER_ENV). */}}
  - {name: RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS, value: "1"}
  {{- if .Values.modelCache.enabled }}
  - {name: FLEETSERVE_CACHE, value: /var/cache/fleetserve/models}
  - {name: VLLM_CACHE_ROOT, value: /var/cache/fleetserve/vllm}
  - {name: HF_HOME, value: /var/cache/fleetserve/huggingface}
  {{- end }}
  {{- if .Values.hubToken.existingSecret }}
  - name: HF_TOKEN
    valueFrom:
      secretKeyRef: {name: {{ .Values.hubToken.existingSecret | quote }}, key: {{ .Values.hubToken.key | quote }}}
  {{- end }}
  {{- if $fastPath }}
  {{- /* Serve's fast path in every Ray process, its proxies too (fleetserve.deployments.serve_options.FAST_PATH_ENV). */}}
  - {name: RAY_SERVE_USE_GRPC_BY_DEFAULT, value: "1"}
  - {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}
  - {name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, value: "5"}
  {{- end }}
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.extraEnvFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  - name: api-keys
    mountPath: /etc/fleetserve
    readOnly: true
  {{- if .Values.modelCache.enabled }}
  - name: model-cache
    mountPath: /var/cache/fleetserve
  {{- end }}
  {{- if .Values.sharedMemory.enabled }}
  - name: dshm
    mountPath: /dev/shm
  {{- end }}
  {{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{- define "fleetserve.volumes" -}}
- name: api-keys
  secret:
    secretName: {{ include "fleetserve.apiKeysSecret" . }}
    optional: true
{{- if .Values.modelCache.enabled }}
- name: model-cache
  {{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim: {claimName: {{ .Values.modelCache.existingClaim | quote }}}
  {{- else }}
  hostPath: {path: {{ .Values.modelCache.hostPath | quote }}, type: DirectoryOrCreate}
  {{- end }}
{{- end }}
{{- if .Values.sharedMemory.enabled }}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .Values.sharedMemory.sizeLimit }}
    sizeLimit: {{ . | quote }}
    {{- end }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
