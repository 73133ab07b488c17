#!/usr/bin/perl

# The isolation review: a zone too small to index every file of its store
# folder (2,500 files, a 1 MB zone holds some 1,600 records) deletes the
# least recently used files rather than forgetting them, so the folder
# holds what the zone counts and max_files / max_size still bound it; new
# sessions that do not fit make the oldest files go too.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
my $slots = LlamaTest::slots_dir($t->dir . '/slots');
my $fp = LlamaTest::fake_fp('fake.gguf');
my $now = time;

for my $i (0 .. 2499) {
    my $name = sprintf 'full%04d-%024x.%s', $i, $i, $fp;
    open my $fh, '>', "$slots/$name.bin" or die;
    print $fh $JSON->encode({ text => "session $i", n => 10 }), ' ' x 2000;
    close $fh;
    utime $now - 5000 + $i, $now - 5000 + $i, "$slots/$name.bin";
}

$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% max_files=5000;',
    extra => 'location /api/ { llama_session_api llama; }'));

sub folder {
    my @bins = grep { !/\.del$/ } glob("$slots/*.bin");
    my $bytes = 0;
    $bytes += -s $_ for @bins;
    return (scalar @bins, $bytes);
}

sub check {
    my ($what) = @_;
    $t->wait_for(sub { !glob("$slots/*.del") }, 5);
    my ($n, $bytes) = folder();
    my $list = $t->get('/api/sessions')->{json};
    is($list->{files}, $n, "$what: the zone counts the folder's $n files");
    is($list->{bytes}, $bytes, "$what: and its $bytes bytes");
    return $n;
}

my $n = check('at start');
ok($n < 2500, "the zone could not hold 2,500 records: $n files are left");
ok(!-e sprintf("$slots/full0000-%024x.$fp.bin", 0), 'the oldest went');
ok(-e sprintf("$slots/full2499-%024x.$fp.bin", 2499), 'the newest stays');
ok($t->log_lines(qr/zone "llama" is full of records: the least recently used files are deleted/),
   'the error log says so, with the fix');

# new sessions, each saved by the next one's swap
for my $i (1 .. 300) {
    my $r = $t->post('/completion', { prompt => "new session $i " . ('w' x 200),
                                      n_predict => 2 },
                     headers => { 'X-Session-Id' => "new$i" });
    if ($r->{status} != 200) { fail("new$i: $r->{status}"); last }
}
check('after 300 new sessions');
ok(scalar(grep { m{/new299-} } glob("$slots/*.bin")),
   'the newest sessions have their files');

$t->stop;
done_testing;
