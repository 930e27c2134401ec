{{/* Labels every object carries: the base's part-of label, plus Helm's own. */}}
{{- define "gpulet.commonLabels" -}}
app.kubernetes.io/part-of: gpulet
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* ... and gpulet's name, on everything but the generated ConfigMaps (as in the base). */}}
{{- define "gpulet.labels" -}}
app.kubernetes.io/name: gpulet
{{ include "gpulet.commonLabels" . }}
{{- end -}}

{{- define "gpulet.image" -}}
{{ required "image.repository is not set: no public gpulet image is published; build it with `make image IMAGE=<registry>/gpulet:<tag>`, push it, and pass --set image.repository=<registry>/gpulet --set image.tag=<tag> (docs/deploy.md)" .Values.image.repository }}{{ with .Values.image.tag }}:{{ . }}{{ end }}
{{- end -}}

{{/* The environment every gpulet container starts with: its node and NATS user. */}}
{{- define "gpulet.natsEnv" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef: {fieldPath: spec.nodeName}
- {name: GPULET_NATS__USER, value: {{ .user }}}
- {name: GPULET_NATS__INBOX_PREFIX, value: _INBOX.{{ .user }}}
- name: GPULET_NATS__PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ .secret }}, key: {{ .user }}}
{{- end -}}

{{- define "gpulet.probes" -}}
startupProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  periodSeconds: 2
  failureThreshold: 30
livenessProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 3
{{- end -}}

{{- define "gpulet.restricted" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "gpulet.rootNoCaps" -}}
runAsUser: 0
runAsGroup: 0
runAsNonRoot: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "gpulet.tokenVolume" -}}
projected:
  sources:
    - serviceAccountToken:
        path: token
        expirationSeconds: 3600
    - configMap:
        name: kube-root-ca.crt
        items:
          - key: ca.crt
            path: ca.crt
    - downwardAPI:
        items:
          - path: namespace
            fieldRef:
              fieldPath: metadata.namespace
{{- end -}}

{{/* Values this version cannot serve fail the render with why. */}}
{{- define "gpulet.validate" -}}
{{- if .Values.kubeletApi -}}
{{- fail (printf "kubeletApi=%s: replaced by dra.mode (device-plugin, both or dra)" .Values.kubeletApi) -}}
{{- end -}}
{{- if not (has .Values.dra.mode (list "device-plugin" "both" "dra")) -}}
{{- fail (printf "dra.mode=%s: one of device-plugin, both, dra" .Values.dra.mode) -}}
{{- end -}}
{{- if not (has .Values.dra.pluginHost (list "allocator" "device-plugin")) -}}
{{- fail (printf "dra.pluginHost=%s: one of allocator, device-plugin" .Values.dra.pluginHost) -}}
{{- end -}}
{{- if ne .Values.mig.strategy "none" -}}
{{- fail (printf "mig.strategy=%s: this version of gpulet serves whole GPUs only (mig.strategy=none)" .Values.mig.strategy) -}}
{{- end -}}
{{- if ne .Values.sharing.strategy "none" -}}
{{- fail (printf "sharing.strategy=%s: this version of gpulet shares GPUs only through Koordinator's gpu-core/gpu-memory resources (sharing.strategy=none)" .Values.sharing.strategy) -}}
{{- end -}}
{{- if not (has .Values.nats.mode (list "embedded" "existing" "fleet")) -}}
{{- fail (printf "nats.mode=%s: one of embedded, existing, fleet" .Values.nats.mode) -}}
{{- end -}}
{{- end -}}


{{/* DRA on: dra.mode both or dra. */}}
{{- define "gpulet.draOn" -}}
{{- if ne .Values.dra.mode "device-plugin" }}true{{ end -}}
{{- end -}}

{{/* Whether .container ("allocator" or "device-plugin") runs the DRA kubelet plugin:
     DRA on and dra.pluginHost names it. */}}
{{- define "gpulet.draHost" -}}
{{- if and (include "gpulet.draOn" .) (eq .Values.dra.pluginHost .container) }}true{{ end -}}
{{- end -}}

{{/* The /dev/nvidia* files through the NVIDIA container runtime, without NVML's use:
     the device plugin's Allocate and the DRA plugin's CDI specs look at which exist. */}}
{{- define "gpulet.nvidiaDevEnv" -}}
- {name: NVIDIA_VISIBLE_DEVICES, value: all}
- {name: NVIDIA_DRIVER_CAPABILITIES, value: utility}
{{- end -}}

{{/* The DRA kubelet plugin's mounts, on the container that runs it: kubelet's plugin
     registry and the plugin's own dir (dra.sock, checkpoint.json) at the host's paths
     (kubelet dials the socket path the plugin registers), and the CDI spec dir. */}}
{{- define "gpulet.draMounts" -}}
- {name: plugins-registry, mountPath: {{ .Values.dra.kubeletDir }}/plugins_registry}
- {name: dra-plugin, mountPath: {{ .Values.dra.kubeletDir }}/plugins/{{ .Values.dra.driver }}}
- {name: cdi, mountPath: /var/run/cdi}
{{- end -}}

{{/* The [dra] settings the values carry, for every container that reads them (the
     reporter, the allocator and the device plugin, so they agree on the mode and on
     which of them hosts the plugin). Only what differs from gpulet's defaults besides
     the mode, so the default render is the kustomize component's with the mode set. */}}
{{- define "gpulet.draEnv" -}}
- {name: GPULET_DRA__MODE, value: {{ .Values.dra.mode }}}
{{- if ne .Values.dra.pluginHost "allocator" }}
- {name: GPULET_DRA__PLUGIN_HOST, value: {{ .Values.dra.pluginHost }}}
{{- end }}
{{- if ne .Values.dra.driver "gpu.gpulet.io" }}
- {name: GPULET_DRA__DRIVER, value: {{ .Values.dra.driver }}}
{{- end }}
{{- if ne .Values.dra.kubeletDir "/var/lib/kubelet" }}
- {name: GPULET_DRA__PLUGINS_REGISTRY, value: {{ .Values.dra.kubeletDir }}/plugins_registry}
- {name: GPULET_DRA__PLUGINS_DIR, value: {{ .Values.dra.kubeletDir }}/plugins}
{{- end }}
{{- if .Values.dra.claimCache }}
- {name: GPULET_DRA__CLAIM_CACHE, value: "true"}
{{- end }}
{{- end -}}
