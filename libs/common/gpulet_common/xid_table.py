"""NVIDIA's XID catalogue as data: one row per code, 1 to 173, and gpulet's reading of it.

Design
------
This module is data only; the health service's ``gpulet_health.catalogue`` builds the
lookup on it. It lives in ``gpulet_common`` because the allocator's remediation
(``gpulet_allocator.service.remediate``) names the catalogue entry (mnemonic, bucket,
application flag) of the fault that evicts a pod, and a service never imports
another's internals. Each row (:class:`Row`) holds:

* ``code`` and ``mnemonic``: NVIDIA's names (the ``ROBUST_CHANNEL_`` prefix dropped);
* ``category``: our own grouping (``hang``, ``ECC``, ``NVLink``, ``media``...;
  ``unused`` for the codes the catalogue calls "Unused");
* ``app``: whether an application can cause it: ``yes`` where the cause matrix of
  NVIDIA's older XID page names the user application, ``check`` where the catalogue's
  investigatory bucket is CHECK_APP/CUDA or INVESTIGATE_SW_USER, else ``no``;
* ``immediate`` and ``investigatory``: NVIDIA's resolution buckets, as the catalogue
  spells them (RESTART_APP, RESET_GPU, RESTART_BM, CHECK_MECHANICALS, WORKFLOW_*...);
  empty where the catalogue gives none (162 to 172, and 173, which only GPUd lists);
* ``severity`` and ``action``: gpulet's reading, from the immediate bucket:

  - RESTART_APP: warning / restart_app;
  - IGNORE: warning / operator_check when the investigatory bucket is CONTACT_SUPPORT
    (nothing to do now, someone should look), else info / none;
  - RESET_GPU, WORKFLOW_NVLINK_ERR, WORKFLOW_NVLINK5_ERR: critical / reset_gpu;
  - WORKFLOW_XID_48: fatal / reset_gpu; RESTART_BM: fatal / reboot;
  - RESTART_VM: critical / reboot; CHECK_MECHANICALS: critical / hardware_inspection;
  - CONTACT_SUPPORT, UPDATE_SWFW, CHECK_UVM: critical / operator_check (NVSentinel
    makes these fatal too);
  - WORKFLOW_XID_45, XID_154: info / none;
  - no bucket (162 to 173): GPUd's severity and action;

  with the exceptions that :data:`NOTES` explains (the severities gpulet had before the
  whole catalogue, for 43, 92, 95, 119 and 120; 140, 167, 169, 173). A warning leaves
  the GPU healthy; critical and fatal make it unhealthy (unless the code is one of
  ``health.app_xids``). Operators override any code in ``health.xid_overrides``.

Sources: NVIDIA's "Analyzing Xid Errors with the Xid Catalog"
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, its Xid-Catalog.xlsx),
read through GPUd's generated mirror (leptonai/gpud,
``components/accelerator/nvidia/xid/catalog_generated.go``, snapshot 2025-10-29);
the application flags from NVIDIA's older XID page's cause matrix (as kept in GPUd's
``pkg/nvidia-query/xid/xid.go``); GPUd's own severities
(``components/accelerator/nvidia/xid/xid.go``) for the codes without a bucket.
``tests/health/data/xid_reference.md`` is the reference table the catalogue test checks
these rows against; ``docs/health.md``'s XID table is generated from them
(``python -m gpulet_health.catalogue --markdown``).
"""

# ruff: noqa: E501  (one row per line: a table reads across)

from __future__ import annotations

from typing import Literal, NamedTuple

from gpulet_common.messages import Action, Severity

AppCause = Literal["yes", "check", "no"]


class Row(NamedTuple):
    code: int
    mnemonic: str
    category: str
    app: AppCause
    immediate: str
    investigatory: str
    severity: Severity
    action: Action
    description: str


_ = Row

# fmt: off
ROWS: tuple[Row, ...] = (
    # code  mnemonic                                            category        app       immediate                investigatory                     severity     action                  description
    _(1,    "FIFO_ERROR_FIFO_METHOD",                           "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(2,    "FIFO_ERROR_SW_METHOD",                             "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(3,    "FIFO_ERROR_UNK_METHOD",                            "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(4,    "FIFO_ERROR_CHANNEL_BUSY",                          "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(5,    "FIFO_ERROR_RUNOUT_OVERFLOW",                       "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(6,    "FIFO_ERROR_PARSE_ERR",                             "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(7,    "FIFO_ERROR_PTE_ERR",                               "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(8,    "FIFO_ERROR_IDLE_TIMEOUT",                          "hang",         "yes",    "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "GPU stopped processing"),
    _(9,    "GR_ERROR_INSTANCE",                                "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(10,   "GR_ERROR_SINGLE_STEP",                             "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(11,   "GR_ERROR_MISSING_HW",                              "pushbuf",      "check",  "RESTART_APP",           "CHECK_APP/CUDA",                 "warning",   "restart_app",          "Invalid or corrupted push buffer stream"),
    _(12,   "GR_ERROR_SW_METHOD",                               "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(13,   "GR_EXCEPTION / GR_ERROR_SW_NOTIFY",                "GR",           "yes",    "RESTART_APP",           "WORKFLOW_XID_13",                "warning",   "restart_app",          "Graphics engine exception"),
    _(14,   "FAKE_ERROR",                                       "unused",       "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "Unused"),
    _(15,   "SCANLINE_TIMEOUT",                                 "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(16,   "VBLANK_CALLBACK_TIMEOUT",                          "unused",       "no",     "CONTACT_SUPPORT",       "CONTACT_SUPPORT",                "critical",  "operator_check",       "Unused"),
    _(17,   "PARAMETER_ERROR",                                  "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(18,   "BUS_MASTER_TIMEOUT_ERROR",                         "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(19,   "DISP_MISSED_NOTIFIER",                             "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(20,   "MPEG_ERROR_SW_METHOD",                             "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(21,   "ME_ERROR_SW_METHOD",                               "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(22,   "VP_ERROR_SW_METHOD",                               "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(23,   "RC_LOGGING_ENABLED",                               "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(24,   "GR_SEMAPHORE_TIMEOUT",                             "unused",       "yes",    "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(25,   "GR_ILLEGAL_NOTIFY",                                "pushbuf",      "yes",    "RESTART_APP",           "CHECK_APP/CUDA",                 "warning",   "restart_app",          "Invalid or illegal push buffer stream"),
    _(26,   "FIFO_ERROR_FBISTATE_TIMEOUT",                      "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(27,   "VP_ERROR",                                         "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(28,   "VP2_ERROR",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(29,   "BSP_ERROR",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(30,   "BAD_ADDR_ACCESS",                                  "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(31,   "FIFO_ERROR_MMU_ERR_FLT",                           "MMU",          "yes",    "RESTART_APP",           "WORKFLOW_XID_31",                "warning",   "restart_app",          "GPU memory page fault"),
    _(32,   "PBDMA_ERROR",                                      "pushbuf",      "check",  "RESTART_APP",           "CHECK_APP/CUDA",                 "warning",   "restart_app",          "Invalid or corrupted push buffer stream"),
    _(33,   "SEC_ERROR",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(34,   "MSVLD_ERROR",                                      "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(35,   "MSPDEC_ERROR",                                     "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(36,   "MSPPP_ERROR",                                      "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(37,   "FECS_ERR_UNIMP_FIRMWARE_METHOD",                   "drv/fw",       "check",  "IGNORE",                "CHECK_APP/CUDA",                 "info",      "none",                 "Driver firmware error"),
    _(38,   "FECS_ERR_WATCHDOG_TIMEOUT",                        "drv/fw",       "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "Driver firmware error"),
    _(39,   "CE0_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine exception"),
    _(40,   "CE1_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine exception"),
    _(41,   "CE2_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine exception"),
    _(42,   "VIC_ERROR",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(43,   "RESETCHANNEL_VERIF_ERROR",                         "hang",         "yes",    "IGNORE",                "CONTACT_SUPPORT",                "warning",   "restart_app",          "GPU stopped processing"),
    _(44,   "GR_FAULT_DURING_CTXSW",                            "GR",           "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "Graphics engine fault during context switch"),
    _(45,   "PREEMPTIVE_REMOVAL",                               "cleanup",      "yes",    "WORKFLOW_XID_45",       "Solo: RESTART_FM; else IGNORE",  "info",      "none",                 "Preemptive cleanup (an application killed, or another fault)"),
    _(46,   "GPU_TIMEOUT_ERROR",                                "hang",         "no",     "RESET_GPU",             "CONTACT_SUPPORT",                "critical",  "reset_gpu",            "GPU stopped processing"),
    _(47,   "NVENC0_ERROR",                                     "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(48,   "GPU_ECC_DBE",                                      "ECC",          "no",     "WORKFLOW_XID_48",       "WORKFLOW_XID_48",                "fatal",     "reset_gpu",            "Double bit ECC error"),
    _(49,   "SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY",    "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(50,   "SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR",  "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(51,   "SILENT_RUNNING_STRESS_TEST_FAILURE",               "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(52,   "SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE",      "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(53,   "SILENT_RUNNING_TEMP_REDUCED_CLOCKING",             "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(54,   "SILENT_RUNNING_PWR_REDUCED_CLOCKING",              "power",        "no",     "CHECK_MECHANICALS",     "CONTACT_SUPPORT",                "critical",  "hardware_inspection",  "Auxiliary power is not connected to the GPU board"),
    _(55,   "SILENT_RUNNING_TEMPERATURE_READ_ERROR",            "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(56,   "DISPLAY_CHANNEL_EXCEPTION",                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(57,   "FB_LINK_TRAINING_FAILURE_ERROR",                   "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(58,   "FB_MEMORY_ERROR",                                  "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(59,   "PMU_ERROR",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(60,   "SEC2_ERROR",                                       "media",        "no",     "RESTART_APP",           "INVESTIGATE_SW",                 "warning",   "restart_app",          "Video processor exception"),
    _(61,   "PMU_BREAKPOINT",                                   "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(62,   "PMU_HALT_ERROR",                                   "µC",           "no",     "RESET_GPU",             "CONTACT_SUPPORT",                "critical",  "reset_gpu",            "Internal micro-controller halt"),
    _(63,   "INFOROM_DRAM_RETIREMENT_EVENT",                    "remap",        "no",     "IGNORE",                "IGNORE",                         "info",      "none",                 "GPU memory remapping event"),
    _(64,   "INFOROM_DRAM_RETIREMENT_FAILURE",                  "remap",        "no",     "RESET_GPU",             "CONTACT_SUPPORT",                "critical",  "reset_gpu",            "GPU memory remapping failure"),
    _(65,   "NVENC1_ERROR",                                     "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(66,   "FECS_ERR_REG_ACCESS_VIOLATION",                    "drv/fw",       "yes",    "IGNORE",                "INVESTIGATE_SW",                 "info",      "none",                 "Illegal access by driver"),
    _(67,   "FECS_ERR_VERIF_VIOLATION",                         "drv/fw",       "yes",    "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "Illegal access by driver"),
    _(68,   "NVDEC0_ERROR",                                     "media",        "yes",    "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC0 exception (video processor)"),
    _(69,   "GR_CLASS_ERROR",                                   "GR",           "check",  "RESTART_APP",           "CHECK_APP/CUDA",                 "warning",   "restart_app",          "Graphics engine class error"),
    _(70,   "CE3_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 3 error"),
    _(71,   "CE4_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 4 error"),
    _(72,   "CE5_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 5 error"),
    _(73,   "NVENC2_ERROR",                                     "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(74,   "NVLINK_ERROR",                                     "NVLink",       "no",     "WORKFLOW_NVLINK_ERR",   "CONTACT_SUPPORT",                "critical",  "reset_gpu",            "NVLink error"),
    _(75,   "CE6_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 6 error"),
    _(76,   "CE7_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 7 error"),
    _(77,   "CE8_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 8 error"),
    _(78,   "VGPU_START_ERROR",                                 "vGPU",         "no",     "UPDATE_SWFW",           "UPDATE_SWFW",                    "critical",  "operator_check",       "vGPU start error"),
    _(79,   "GPU_HAS_FALLEN_OFF_THE_BUS",                       "PCIe",         "no",     "RESTART_BM",            "CONTACT_SUPPORT",                "fatal",     "reboot",               "GPU has fallen off the bus"),
    _(80,   "PBDMA_PUSHBUFFER_CRC_MISMATCH",                    "pushbuf",      "check",  "RESTART_APP",           "CHECK_APP/CUDA",                 "warning",   "restart_app",          "Corrupted data sent to GPU"),
    _(81,   "VGA_SUBSYSTEM_ERROR",                              "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(82,   "NVJPG0_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG0 error"),
    _(83,   "NVDEC1_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC1 error"),
    _(84,   "NVDEC2_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC2 error"),
    _(85,   "CE9_ERROR",                                        "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 9 error"),
    _(86,   "OFA0_ERROR",                                       "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "OFA exception"),
    _(87,   "NVTELEMETRY_DRIVER_REPORT",                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(88,   "NVDEC3_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC3 error"),
    _(89,   "NVDEC4_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC4 error"),
    _(90,   "LTC_ERROR",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(91,   "RESERVED_XID",                                     "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(92,   "EXCESSIVE_SBE_INTERRUPTS",                         "ECC/InfoROM",  "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "none",                 "High single-bit ECC error rate"),
    _(93,   "INFOROM_ERASE_LIMIT_EXCEEDED",                     "ECC/InfoROM",  "yes",    "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "Non-fatal violation of the provisioned InfoROM wear limit"),
    _(94,   "CONTAINED_ERROR",                                  "ECC",          "no",     "RESTART_APP",           "IGNORE (sympathetic)",           "warning",   "restart_app",          "Contained memory error"),
    _(95,   "UNCONTAINED_ERROR",                                "ECC",          "no",     "RESET_GPU",             "IGNORE (sympathetic)",           "fatal",     "reset_gpu",            "Uncontained memory error"),
    _(96,   "NVDEC5_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC5 error"),
    _(97,   "NVDEC6_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC6 error"),
    _(98,   "NVDEC7_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVDEC7 error"),
    _(99,   "NVJPG1_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG1 error"),
    _(100,  "NVJPG2_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG2 error"),
    _(101,  "NVJPG3_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG3 error"),
    _(102,  "NVJPG4_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG4 error"),
    _(103,  "NVJPG5_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG5 error"),
    _(104,  "NVJPG6_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG6 error"),
    _(105,  "NVJPG7_ERROR",                                     "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "NVJPG7 error"),
    _(106,  "SMBPBI_TEST_MESSAGE",                              "test",         "yes",    "IGNORE",                "IGNORE",                         "info",      "none",                 "SMBPBI test message"),
    _(107,  "SMBPBI_TEST_MESSAGE_SILENT",                       "test",         "yes",    "IGNORE",                "IGNORE",                         "info",      "none",                 "SMBPBI test message (silent)"),
    _(108,  "NVLINK_REMOTE_TRANSLATION_ERROR",                  "unused",       "no",     "IGNORE",                "XID_137_FLOW",                   "info",      "none",                 "Unused"),
    _(109,  "CTXSW_TIMEOUT_ERROR",                              "hang",         "yes",    "RESET_GPU",             "CONTACT_SUPPORT",                "critical",  "reset_gpu",            "Context switch timeout error"),
    _(110,  "SEC_FAULT_ERROR",                                  "security",     "no",     "RESET_GPU",             "INVESTIGATE_SW",                 "critical",  "reset_gpu",            "Security fault error"),
    _(111,  "BUNDLE_ERROR_EVENT",                               "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(112,  "DISP_SUPERVISOR_ERROR",                            "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(113,  "DP_LT_FAILURE",                                    "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(114,  "HEAD_RG_UNDERFLOW",                                "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(115,  "CORE_CHANNEL_REGS",                                "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(116,  "WINDOW_CHANNEL_REGS",                              "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(117,  "CURSOR_CHANNEL_REGS",                              "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(118,  "HEAD_REGS",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(119,  "GSP_RPC_TIMEOUT",                                  "GSP",          "no",     "RESET_GPU",             "INVESTIGATE_SW",                 "fatal",     "reset_gpu",            "GSP RPC timeout"),
    _(120,  "GSP_ERROR",                                        "GSP",          "no",     "RESET_GPU",             "INVESTIGATE_SW",                 "fatal",     "reset_gpu",            "GSP error"),
    _(121,  "C2C_ERROR",                                        "C2C",          "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "C2C error"),
    _(122,  "SPI_PMU_RPC_READ_FAIL",                            "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(123,  "SPI_PMU_RPC_WRITE_FAIL",                           "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(124,  "SPI_PMU_RPC_ERASE_FAIL",                           "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(125,  "INFOROM_FS_ERROR",                                 "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(126,  "CE10_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 10 error"),
    _(127,  "CE11_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 11 error"),
    _(128,  "CE12_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 12 error"),
    _(129,  "CE13_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 13 error"),
    _(130,  "CE14_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 14 error"),
    _(131,  "CE15_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 15 error"),
    _(132,  "CE16_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 16 error"),
    _(133,  "CE17_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 17 error"),
    _(134,  "CE18_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 18 error"),
    _(135,  "CE19_ERROR",                                       "CE",           "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "Copy engine 19 error"),
    _(136,  "ALI_TRAINING_FAIL",                                "NVLink",       "no",     "RESET_GPU",             "INVESTIGATE_LINK_SI",            "critical",  "reset_gpu",            "NVLink link training failed"),
    _(137,  "NVLINK_PRIV_ERR",                                  "NVLink",       "yes",    "IGNORE",                "XID_137_FLOW",                   "info",      "none",                 "NVLink privilege error"),
    _(138,  "DLA_ERROR",                                        "unused",       "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "Unused"),
    _(139,  "OFA1_ERROR",                                       "media",        "no",     "RESTART_APP",           "CONTACT_SUPPORT",                "warning",   "restart_app",          "OFA1 error"),
    _(140,  "UNRECOVERABLE_ECC_ERROR_ESCAPE",                   "ECC",          "no",     "RESET_GPU",             "CONTACT_SUPPORT",                "fatal",     "reset_gpu",            "ECC unrecovered error"),
    _(141,  "FAST_PATH_ERROR",                                  "CUDA",         "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "CUDA fast path error"),
    _(142,  "NVENC3_ERROR",                                     "media",        "no",     "CONTACT_SUPPORT",       "",                               "critical",  "operator_check",       "NVENC3 error"),
    _(143,  "GPU_INIT_ERROR",                                   "init",         "no",     "RESET_GPU",             "CONTACT_SUPPORT",                "critical",  "reset_gpu",            "GPU initialization error"),
    _(144,  "NVLINK_SAW_ERROR",                                 "NVLink",       "no",     "WORKFLOW_NVLINK5_ERR",  "WORKFLOW_NVLINK5_ERR",           "critical",  "reset_gpu",            "NVLink: SAW error"),
    _(145,  "NVLINK_RLW_ERROR",                                 "NVLink",       "no",     "WORKFLOW_NVLINK5_ERR",  "WORKFLOW_NVLINK5_ERR",           "critical",  "reset_gpu",            "NVLink: RLW error"),
    _(146,  "NVLINK_TLW_ERROR",                                 "NVLink",       "no",     "WORKFLOW_NVLINK5_ERR",  "WORKFLOW_NVLINK5_ERR",           "critical",  "reset_gpu",            "NVLink: TLW error"),
    _(147,  "NVLINK_TREX_ERROR",                                "NVLink",       "no",     "WORKFLOW_NVLINK5_ERR",  "WORKFLOW_NVLINK5_ERR",           "critical",  "reset_gpu",            "NVLink: TREX error"),
    _(148,  "NVLINK_NVLPW_CTRL_ERROR",                          "NVLink",       "no",     "WORKFLOW_NVLINK5_ERR",  "WORKFLOW_NVLINK5_ERR",           "critical",  "reset_gpu",            "NVLink: NVLPW_CTRL error"),
    _(149,  "NVLINK_NETIR_ERROR",                               "NVLink",       "no",     "WORKFLOW_NVLINK5_ERR",  "WORKFLOW_NVLINK5_ERR",           "critical",  "reset_gpu",            "NVLink: NETIR error"),
    _(150,  "NVLINK_MSE_ERROR",                                 "NVLink",       "no",     "WORKFLOW_NVLINK5_ERR",  "WORKFLOW_NVLINK5_ERR",           "critical",  "reset_gpu",            "NVLink: MSE error"),
    _(151,  "KEY_ROTATION_ERROR",                               "CC",           "no",     "RESTART_VM",            "CONTACT_SUPPORT",                "critical",  "reboot",               "Key rotation error (confidential computing)"),
    _(152,  "DLA_SMMU_ERROR",                                   "DLA",          "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "DLA SMMU error"),
    _(153,  "DLA_TIMEOUT",                                      "DLA",          "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "DLA timeout error"),
    _(154,  "GPU_RECOVERY_ACTION_CHANGED",                      "info",         "no",     "XID_154",               "N/A (informational)",            "info",      "none",                 "GPU recovery action changed"),
    _(155,  "NVLINK_SW_DEFINED_ERROR",                          "NVLink",       "check",  "RESET_GPU",             "INVESTIGATE_SW_USER",            "critical",  "reset_gpu",            "NVLink: software-defined error"),
    _(156,  "RESOURCE_RETIREMENT_EVENT",                        "remap",        "no",     "RESET_GPU",             "IGNORE",                         "critical",  "reset_gpu",            "Resource retirement event"),
    _(157,  "RESOURCE_RETIREMENT_FAILURE",                      "remap",        "no",     "IGNORE",                "CONTACT_SUPPORT",                "warning",   "operator_check",       "Resource retirement failure"),
    _(158,  "GPU_FATAL_TIMEOUT",                                "hang",         "no",     "RESET_GPU",             "CONTACT_SUPPORT",                "critical",  "reset_gpu",            "GPU fatal timeout"),
    _(159,  "CHI_NON_DATA_ERROR",                               "CHI",          "no",     "CHECK_UVM",             "SYMPATHETIC_REPORT_SOLO",        "critical",  "operator_check",       "CHI non-data error"),
    _(160,  "CHANNEL_RETIREMENT_EVENT",                         "chan-retire",  "no",     "IGNORE",                "INVESTIGATE_SW",                 "info",      "none",                 "Channel retirement event"),
    _(161,  "CHANNEL_RETIREMENT_FAILURE",                       "chan-retire",  "no",     "IGNORE",                "INVESTIGATE_SW",                 "info",      "none",                 "Channel retirement failure"),
    _(162,  "PSHC_REENGAGED",                                   "power",        "no",     "",                      "",                               "info",      "none",                 "Power smoothing HW circuitry capability re-engaged"),
    _(163,  "PSHC_DISENGAGED",                                  "power",        "no",     "",                      "",                               "warning",   "reboot",               "Power smoothing HW circuitry capability disengaged"),
    _(164,  "PSHC_LOW_LIFETIME",                                "power",        "no",     "",                      "",                               "info",      "none",                 "Power smoothing HW circuitry low lifetime reached"),
    _(165,  "PSHC_ZERO_LIFETIME",                               "power",        "no",     "",                      "",                               "info",      "none",                 "Power smoothing HW circuitry lifetime exhausted"),
    _(166,  "NVLINK_SECURE_CRYPTO_ERR",                         "NVLink/CC",    "no",     "",                      "",                               "warning",   "reboot",               "CC traffic seen before the link was configured for encrypted traffic"),
    _(167,  "PCIE_FATAL_TIMEOUT",                               "PCIe",         "no",     "",                      "",                               "critical",  "reboot",               "PCIe fatal timeout"),
    _(168,  "REDUCED_GPU_MEMORY_CAPACITY",                      "mem/WPR",      "no",     "",                      "",                               "warning",   "operator_check",       "Errors found in WPR (write-protected region)"),
    _(169,  "SEC2_HALT_ERROR",                                  "µC",           "no",     "",                      "",                               "critical",  "reset_gpu",            "Internal micro-controller halt (SEC2)"),
    _(170,  "NVLINK_SECURE_OTHER",                              "NVLink/CC",    "no",     "",                      "",                               "warning",   "restart_app",          "Interrupt seen in CC mode"),
    _(171,  "UNCORRECTABLE_DRAM_ERROR",                         "ECC",          "no",     "",                      "",                               "warning",   "operator_check",       "Uncorrectable DRAM error (details of an XID 48)"),
    _(172,  "UNCORRECTABLE_SRAM_ERROR",                         "ECC",          "no",     "",                      "",                               "warning",   "reboot",               "Uncorrectable SRAM error (details of an XID 48)"),
    _(173,  "",                                                 "C2C",          "no",     "",                      "",                               "critical",  "reboot",               "C2C fatal link failure (GPUd only, not in NVIDIA's catalogue snapshot)"),
)
# fmt: on

# Why a row departs from the bucket's reading, or what else to know about it.
NOTES: dict[int, str] = {
    38: "catalogue IGNORE, GPUd fatal: reported as a warning to look at",
    43: "kept from gpulet's earlier table (NVIDIA device plugin: application); a by-product after another fault",
    44: "catalogue IGNORE, GPUd fatal: reported as a warning to look at",
    45: "a by-product: evidence for another fault on the GPU, never a fault of its own",
    63: "the remap rule reads NVML's row-remapping state",
    68: "an application XID by default (health.app_xids); GPUd makes it fatal",
    92: "kept from gpulet's earlier table; the ECC rate rule watches the counters",
    95: "fatal like XID 48: uncontained corruption (earlier table, NVSentinel/GPUd)",
    109: "RESET_GPU in the catalogue; an application XID by default (health.app_xids)",
    119: "fatal as in gpulet's earlier table (NVSentinel/GPUd)",
    120: "fatal as in gpulet's earlier table (NVSentinel/GPUd)",
    121: "catalogue IGNORE, GPUd fatal: reported as a warning to look at",
    140: "fatal like XID 95: an uncorrectable ECC error escaped containment",
    144: "NVIDIA's decode of intrinfo/error status (not done here) makes some non-fatal; critical until decoded",
    145: "NVIDIA's decode of intrinfo/error status (not done here) makes some non-fatal; critical until decoded",
    146: "NVIDIA's decode of intrinfo/error status (not done here) makes some non-fatal; critical until decoded",
    147: "NVIDIA's decode of intrinfo/error status (not done here) makes some non-fatal; critical until decoded",
    148: "NVIDIA's decode of intrinfo/error status (not done here) makes some non-fatal; critical until decoded",
    149: "NVIDIA's decode of intrinfo/error status (not done here) makes some non-fatal; critical until decoded",
    150: "NVIDIA's decode of intrinfo/error status (not done here) makes some non-fatal; critical until decoded",
    154: "the recovery action the driver asks for (NVML field 230)",
    162: "no bucket in the catalogue: GPUd's severity and action",
    163: "no bucket in the catalogue: GPUd's severity and action",
    164: "no bucket in the catalogue: GPUd's severity and action",
    165: "no bucket in the catalogue: GPUd's severity and action",
    166: "no bucket in the catalogue: GPUd's severity and action",
    167: "no bucket in the catalogue; a fatal PCIe timeout: GPUd's reboot, raised to critical",
    168: "no bucket in the catalogue: GPUd's severity and action",
    169: "no bucket in the catalogue; a micro-controller halt, treated like XID 62",
    170: "no bucket in the catalogue: GPUd's severity and action",
    171: "no bucket in the catalogue: GPUd's severity and action",
    172: "no bucket in the catalogue: GPUd's severity and action",
    173: "GPUd only; a fatal C2C link failure: GPUd's reboot, raised to critical",
}
