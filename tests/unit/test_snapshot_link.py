"""A ward's copy held on its own host is a hard link to the ward's slot file
(worker/trainer/snapshot.py `Ring.link`): it outlives the ward's directory, a rewrite by the
ward voids it through the image's stamp, and the holder never writes into the ward's file;
an offer counts as on this host by that stamp."""

from __future__ import annotations

import shutil
from pathlib import Path

from worker.snapshots import complete_slots, encode_manifest, slot_paths
from worker.trainer.snapshot import Ring
from worker.trainer.snapshot_state import write_stamp
from worker.trainer.snapshot_wire import Offer

G = 1
NBYTES = 4096


def manifest(step: int) -> dict:
    return {"id": f"{step:016x}", "step": step, "generation": G, "rank": 1, "nbytes": NBYTES}


def take(own: Ring, step: int) -> Path:
    """What the snapshot thread does for one step: claim, copy, stamp, commit."""
    i, bin_path, man_path, image = own.claim(NBYTES)
    image[64:NBYTES].fill_(step)
    write_stamp(image, manifest(step))
    own.commit(i, man_path, manifest(step))
    return bin_path


def hold(held: Ring, src: Path, step: int) -> None:
    """What the holder does with a ward's offer on its own host."""
    held.link(src, manifest(step), encode_manifest(manifest(step)))


def payload(path: Path) -> set[int]:
    return set(path.read_bytes()[64:NBYTES])


def test_a_held_link_outlives_the_wards_directory(tmp_path):
    own, held = Ring(tmp_path / "ward" / "r1", 2), Ring(tmp_path / "holder" / "held" / "r1", 2)
    hold(held, take(own, 5), 5)
    shutil.rmtree(tmp_path / "ward")  # the ward's worker left the job: its agent deleted it
    slots = complete_slots(held.d, G)
    assert sorted(slots) == [5]
    assert payload(slots[5].bin) == {5}


def test_a_wards_rewrite_voids_the_held_link_to_that_slot(tmp_path):
    own, held = Ring(tmp_path / "ward" / "r1", 2), Ring(tmp_path / "holder" / "held" / "r1", 2)
    for step in (1, 2):
        hold(held, take(own, step), step)
    assert sorted(complete_slots(held.d, G)) == [1, 2]
    own.claim(NBYTES)  # the ward starts rewriting step 1's slot: the holder's manifest stays
    assert sorted(complete_slots(held.d, G)) == [2]
    # and once the ward's slot holds step 3, the old manifest still does not match it
    i = (own.next - 1) % own.size
    bin_path, man_path = slot_paths(own.d, i)
    image = own.maps[bin_path]
    image[64:NBYTES].fill_(3)
    write_stamp(image, manifest(3))
    own.commit(i, man_path, manifest(3))
    assert sorted(complete_slots(held.d, G)) == [2]
    hold(held, bin_path, 3)
    assert sorted(complete_slots(held.d, G)) == [2, 3]


def test_linking_the_same_file_again_keeps_one_inode(tmp_path):
    own, held = Ring(tmp_path / "ward" / "r1", 2), Ring(tmp_path / "holder" / "held" / "r1", 2)
    for step in (1, 2, 3, 4):
        hold(held, take(own, step), step)
    inodes = {p.stat().st_ino for p in held.d.glob("slot-*.bin")}
    assert inodes == {p.stat().st_ino for p in own.d.glob("slot-*.bin")}
    assert [p.stat().st_nlink for p in sorted(own.d.glob("slot-*.bin"))] == [2, 2]


def test_a_held_ring_never_writes_into_a_linked_file(tmp_path):
    """A holder that later receives the ward's bytes over the network (the ward moved
    hosts) writes a file of its own, not the ward's."""
    own, held = Ring(tmp_path / "ward" / "r1", 2), Ring(tmp_path / "holder" / "held" / "r1", 2)
    ward_file = take(own, 1)
    hold(held, ward_file, 1)
    held.next = 0  # the network copy lands in the slot that holds the link
    _, bin_path, _, image = held.claim(NBYTES)
    image.fill_(9)
    assert not bin_path.samefile(ward_file)
    assert payload(ward_file) == {1}
    assert sorted(complete_slots(own.d, G)) == [1]
    assert set(bin_path.read_bytes()) == {9}


def test_an_offer_is_visible_only_where_its_file_holds_the_offered_slot(tmp_path):
    """What decides link (or memory copy) against network: the offered file's stamp. Another
    host's same-named file, or the ward's slot once it is being rewritten, is not the slot."""
    own = Ring(tmp_path / "ward" / "r1", 2)
    ward_file = take(own, 4)
    offer = Offer(encode_manifest(manifest(4)), NBYTES, ward_file)
    assert offer.visible()
    assert not Offer(encode_manifest(manifest(5)), NBYTES, ward_file).visible()
    assert not Offer(offer.raw, NBYTES, tmp_path / "elsewhere" / ward_file.name).visible()
    longer = {**manifest(4), "nbytes": NBYTES + 64}  # the file lacks some of its bytes
    assert not Offer(encode_manifest(longer), NBYTES + 64, ward_file).visible()
    assert not Offer(b'{"step": 4}', NBYTES, ward_file).visible()  # names no id
    own.next = 0
    own.claim(NBYTES)  # the ward starts rewriting that slot
    assert not offer.visible()
