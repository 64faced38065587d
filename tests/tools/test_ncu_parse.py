"""The GPU suite's Nsight Compute readers (tools/gpu_suite/studies.py) on hand-written ncu CSV: the details page
(one launch's metrics and rules, the program's own lines mixed in) and the per-instruction source page."""

from tools.gpu_suite.studies import parse_ncu_csv, summarize_sass_csv

DETAILS = '''==PROF== Connected to process 1
fp8 b256 ctx600 {}: 140.1 us a launch, 2245 GB/s
"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type","Rule Description"
"0","_decode_split_kernel","GPU Speed Of Light Throughput","DRAM Throughput","%","68.63","","",""
"0","_decode_split_kernel","GPU Speed Of Light Throughput","Duration","us","140.42","","",""
"0","_decode_split_kernel","Occupancy","Achieved Occupancy","%","23.98","","",""
"0","_decode_split_kernel","SourceCounters","","","","UncoalescedGlobalAccess","OPT","5242880 excessive sectors"
'''

HEADER = ",".join(f'"{c}"' for c in (
    "Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)",
    "L2 Theoretical Sectors Global Excessive", "L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Ideal",
    "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"))
SOURCE = "\n".join([
    '"Kernel Name","_decode_split_kernel",',
    HEADER,
    '"0x10","      LDGSTS.E.BYPASS.128 [R89], desc[UR12][R14.64]","8,192","10","0","131,072","131,072","9","1","9"',
    '"0x20","      LDGSTS.E.BYPASS.128 [R89+0x4000], desc[UR12][R16.64]","8,192","30","131,072","262,144","131,072",'
    '"25","5","25"',
    '"0x30","@!P4  F2FP.F16.E4M3.UNPACK_B R24, R64","16,384","60","0","0","0","0","60","0"',
    '"0x40","","0","0","0","0","0","0","0","0"',  # a row without an instruction (a label) is skipped
])


def test_details_page_one_launch():
    (launch,) = parse_ncu_csv(DETAILS)
    assert launch["kernel"] == "_decode_split_kernel"
    assert launch["DRAM Throughput"] == "68.63 %"
    assert launch["Achieved Occupancy"] == "23.98 %"
    assert launch["sections"]["GPU Speed Of Light Throughput"]["Duration"] == "140.42 us"
    assert launch["rules"] == ["UncoalescedGlobalAccess: 5242880 excessive sectors"]


def test_source_page_mix_stalls_and_uncoalesced_loads():
    summary = summarize_sass_csv(SOURCE)
    assert summary["warp_instructions"] == 32768
    assert summary["mix_pct"] == {"LDGSTS.E.BYPASS.128": 50.0, "F2FP.F16.E4M3.UNPACK_B": 50.0}
    # the "(Not Issued)" columns are not counted twice
    assert summary["stall_pct"] == {"stall_wait": 66.0, "stall_long_sb": 34.0}
    assert summary["uncoalesced_loads"] == {"sectors": 262144, "ideal": 131072}


def test_source_page_missing_table():
    assert summarize_sass_csv("==ERROR== no kernels profiled") == {"error": "no source table"}
